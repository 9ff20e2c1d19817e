"""Explicit weight maps from Hugging Face GPT-2 / Llama state dicts to Megatron-Core GPTModel keys.

Written from the layouts in reference/megatron-compat.md section 8.4, independently of the model code,
so that logits parity proves both the model and the layouts.
"""

import torch


def gpt2_qkv_to_megatron(c_attn: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF GPT-2 `c_attn` (Conv1D weight [h, 3h] = columns [Q_all | K_all | V_all], or its bias [3h]) ->
    Megatron `linear_qkv` rows [np, 3, hn] (q0 k0 v0 q1 k1 v1 ...), weight [3h, h]."""
    if c_attn.dim() == 2:
        rows = c_attn.t()  # Conv1D stores [in, out]; Linear wants [out, in]
        three_h, h = rows.shape
        return rows.reshape(3, num_heads, three_h // (3 * num_heads), h).transpose(0, 1).reshape(three_h, h)
    return c_attn.reshape(3, num_heads, -1).transpose(0, 1).reshape(-1)


def gpt2_to_megatron(hf_state: dict, num_layers: int, num_heads: int) -> dict:
    """GPT-2 LM head model state dict -> GPTModel (tied embeddings, learned positions, biases)."""
    out = {
        "embedding.word_embeddings.weight": hf_state["transformer.wte.weight"],
        "embedding.position_embeddings.weight": hf_state["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": hf_state["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": hf_state["transformer.ln_f.bias"],
    }
    for i in range(num_layers):
        hf, mc = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for suffix in ("weight", "bias"):
            out[mc + f"input_layernorm.{suffix}"] = hf_state[hf + f"ln_1.{suffix}"]
            out[mc + f"pre_mlp_layernorm.{suffix}"] = hf_state[hf + f"ln_2.{suffix}"]
            out[mc + f"self_attention.linear_qkv.{suffix}"] = gpt2_qkv_to_megatron(
                hf_state[hf + f"attn.c_attn.{suffix}"], num_heads
            )
        conv1d_layers = (
            ("attn.c_proj", "self_attention.linear_proj"),
            ("mlp.c_fc", "mlp.linear_fc1"),
            ("mlp.c_proj", "mlp.linear_fc2"),
        )
        for hf_name, mc_name in conv1d_layers:
            out[mc + mc_name + ".weight"] = hf_state[hf + hf_name + ".weight"].t()  # Conv1D transpose
            out[mc + mc_name + ".bias"] = hf_state[hf + hf_name + ".bias"]
    return out


def llama_qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int):
    """Separate q [np*hn, h], k and v [ng*hn, h] -> per-group rows: for each group g its np/ng query
    heads, then k_g, then v_g. HF's repeat_kv gives query head j the key head j // (np/ng), the same
    grouping."""
    h = q.size(1)
    head_dim = q.size(0) // num_heads
    q = q.reshape(num_groups, num_heads // num_groups, head_dim, h)
    k = k.reshape(num_groups, 1, head_dim, h)
    v = v.reshape(num_groups, 1, head_dim, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def llama_to_megatron(hf_state: dict, num_layers: int, num_heads: int, num_groups: int) -> dict:
    """LlamaForCausalLM state dict -> GPTModel (RMSNorm, SwiGLU fc1 = cat([gate, up]), untied, no bias)."""
    out = {
        "embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf_state["model.norm.weight"],
        "output_layer.weight": hf_state["lm_head.weight"],
    }
    for i in range(num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mc + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[mc + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        out[mc + "self_attention.linear_qkv.weight"] = llama_qkv_to_megatron(
            hf_state[hf + "self_attn.q_proj.weight"],
            hf_state[hf + "self_attn.k_proj.weight"],
            hf_state[hf + "self_attn.v_proj.weight"],
            num_heads,
            num_groups,
        )
        out[mc + "self_attention.linear_proj.weight"] = hf_state[hf + "self_attn.o_proj.weight"]
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[hf + "mlp.gate_proj.weight"], hf_state[hf + "mlp.up_proj.weight"]], dim=0
        )
        out[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"]
    return out
