"""Megatron-Core `GPTModel` state dict <-> Hugging Face `LlamaForCausalLM` family (Llama, Mistral, Qwen2,
and `MixtralForCausalLM` for mixture-of-experts models).

One function per transform:

    qkv_to_llama / qkv_from_llama   per-group rows [ng, np/ng + 2, hn] <-> q_proj [np*hn], k/v_proj [ng*hn]
    fc1_to_llama / fc1_from_llama   SwiGLU linear_fc1 = cat([gate_proj, up_proj], dim 0)
    moe_to_mixtral / moe_from_mixtral   router.weight = block_sparse_moe.gate.weight [E, h]; expert e's
                                    linear_fc1 = cat([w1 (gate), w3 (up)]), linear_fc2 = w2
    trim_to_tokenizer               padded vocabulary rows dropped (vocab_padding.py)

No RoPE permutation: Megatron-Core's non-interleaved rotary embedding rotates halves
(`rotate_half`), exactly as `transformers` does, so HF q/k weights are used as they are (reference 8.3;
the permutation is only for Meta's interleaved checkpoints, which --rotary-interleaved would need).
HF's `repeat_kv` gives query head j the key head j // (np/ng): the same grouping as Megatron's rows.

Which class: no biases -> LlamaForCausalLM; biases only on q/k/v (--add-qkv-bias) -> Qwen2ForCausalLM;
biases on every linear (--add-bias-linear) -> Llama with attention_bias and mlp_bias. Mistral checkpoints
(Llama's shape; `sliding_window` unset) import like Llama. Experts in every layer -> Mixtral, whose
router takes the top-k of softmax(logits) and renormalises them: Megatron's default router (top-k of the
logits, softmax over those k) computes the same weights; --moe-router-pre-softmax (no renormalisation)
does not for k > 1, nor does a sigmoid router. Mixtral routes every token (no capacity), so a model
trained with --moe-expert-capacity-factor exports as its dropless counterpart.
"""

import torch

from megatron.training.checkpointing.conversion.gpt_shape import GPTShape
from megatron.training.checkpointing.conversion.vocab_padding import trim_to_tokenizer

IMPORTABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
# Megatron-Core's Llama-3.1 RoPE scaling has these constants (rotary_pos_embedding.apply_llama3_scaling).
_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}


def llama_export_problems(shape: GPTShape) -> list[str]:
    """What the Llama family cannot represent of `shape` (empty when it can)."""
    checks = (
        (shape.normalization != "RMSNorm", f"--normalization {shape.normalization} (Llama uses RMSNorm)"),
        (shape.position_embedding_type != "rope",
         f"--position-embedding-type {shape.position_embedding_type} (Llama uses rope)"),
        (not shape.swiglu, "no --swiglu (Llama's MLP is SwiGLU)"),
        (shape.qk_layernorm, "--qk-layernorm (Llama has no query/key norms)"),
        (shape.mla is not None, "--multi-latent-attention"),
        (shape.mtp_num_layers, "--mtp-num-layers (Llama has no multi-token prediction layers)"),
    )
    problems = [message for failed, message in checks if failed]
    if shape.num_experts:
        moe_checks = (
            (shape.moe_shared_expert_intermediate_size, "--moe-shared-expert-intermediate-size (Mixtral has no "
                                                        "shared experts)"),
            (shape.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
            (shape.moe_router_num_groups, "--moe-router-num-groups (group-limited routing)"),
            (shape.moe_router_topk_scaling_factor not in (None, 1.0), "--moe-router-topk-scaling-factor"),
            (not all(shape.moe_layers), "--moe-layer-freq with dense layers (Mixtral has experts in every layer)"),
            (shape.qkv_bias, "--add-qkv-bias (Mixtral's attention has no biases)"),
            (shape.moe_router_score_function != "softmax",
             f"--moe-router-score-function {shape.moe_router_score_function} (Mixtral's router is a softmax)"),
            (shape.moe_router_pre_softmax and shape.moe_router_topk > 1,
             "--moe-router-pre-softmax (Mixtral renormalises the top-k weights)"),
        )
        problems += [message for failed, message in moe_checks if failed]
    return problems


def qkv_to_llama(qkv: torch.Tensor, shape: GPTShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_qkv` weight [ng*(np/ng+2)*hn, h] (or bias) -> q [np*hn, ...], k [ng*hn, ...], v [ng*hn, ...].

    View [ng, np/ng + 2, hn, ...]: each group's np/ng query heads, then its key head, then its value head.
    """
    groups, hn = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, hn, *rest)
    q = grouped[:, :per_group].reshape(groups * per_group * hn, *rest)
    k = grouped[:, per_group].reshape(groups * hn, *rest)
    v = grouped[:, per_group + 1].reshape(groups * hn, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def qkv_from_llama(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: GPTShape) -> torch.Tensor:
    """Inverse of `qkv_to_llama`: cat([q.view(ng, np/ng*hn), k.view(ng, hn), v.view(ng, hn)], dim 1) rows."""
    groups, hn = shape.num_query_groups, shape.kv_channels
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(groups, -1, hn, *rest), k.reshape(groups, 1, hn, *rest), v.reshape(groups, 1, hn, *rest)], dim=1
    )
    return grouped.reshape(-1, *rest)


def fc1_to_llama(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU `linear_fc1` [2f, ...] -> (gate_proj [f, ...], up_proj [f, ...]); the first half is the gate."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def fc1_from_llama(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """cat([gate_proj, up_proj], dim 0) = `linear_fc1` of the whole (TP=1) model."""
    return torch.cat([gate, up], dim=0)


def _expert(megatron: str, expert: int, linear: str) -> str:
    return f"{megatron}mlp.experts.local_experts.{expert}.{linear}.weight"


def moe_to_mixtral(state: dict, megatron: str, hf: str, shape: GPTShape) -> dict:
    """One MoE layer's router and experts (Megatron prefix `decoder.layers.N.`) as Mixtral's block_sparse_moe."""
    out = {f"{hf}block_sparse_moe.gate.weight": state[f"{megatron}mlp.router.weight"]}
    for expert in range(shape.num_experts):
        gate, up = fc1_to_llama(state[_expert(megatron, expert, "linear_fc1")])
        names = (f"{hf}block_sparse_moe.experts.{expert}.{name}.weight" for name in ("w1", "w3", "w2"))
        out.update(zip(names, (gate, up, state[_expert(megatron, expert, "linear_fc2")])))
    return out


def moe_from_mixtral(hf_state: dict, megatron: str, hf: str, shape: GPTShape) -> dict:
    """Inverse of `moe_to_mixtral`."""
    out = {f"{megatron}mlp.router.weight": hf_state[f"{hf}block_sparse_moe.gate.weight"]}
    for expert in range(shape.num_experts):
        w1, w3, w2 = (hf_state[f"{hf}block_sparse_moe.experts.{expert}.{name}.weight"] for name in ("w1", "w3", "w2"))
        out[_expert(megatron, expert, "linear_fc1")] = fc1_from_llama(w1, w3)
        out[_expert(megatron, expert, "linear_fc2")] = w2
    return out


def _layer_to_llama(state: dict, i: int, shape: GPTShape) -> dict:
    megatron, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {
        f"{hf}input_layernorm.weight": state[f"{megatron}input_layernorm.weight"],
        f"{hf}post_attention_layernorm.weight": state[f"{megatron}pre_mlp_layernorm.weight"],
        f"{hf}self_attn.o_proj.weight": state[f"{megatron}self_attention.linear_proj.weight"],
    }
    q, k, v = qkv_to_llama(state[f"{megatron}self_attention.linear_qkv.weight"], shape)
    out.update({f"{hf}self_attn.q_proj.weight": q, f"{hf}self_attn.k_proj.weight": k,
                f"{hf}self_attn.v_proj.weight": v})
    if shape.num_experts:
        out.update(moe_to_mixtral(state, megatron, hf, shape))
    else:
        gate, up = fc1_to_llama(state[f"{megatron}mlp.linear_fc1.weight"])
        out.update({f"{hf}mlp.gate_proj.weight": gate, f"{hf}mlp.up_proj.weight": up,
                    f"{hf}mlp.down_proj.weight": state[f"{megatron}mlp.linear_fc2.weight"]})
    if shape.qkv_bias:
        q, k, v = qkv_to_llama(state[f"{megatron}self_attention.linear_qkv.bias"], shape)
        out.update({f"{hf}self_attn.q_proj.bias": q, f"{hf}self_attn.k_proj.bias": k, f"{hf}self_attn.v_proj.bias": v})
    if shape.add_bias_linear:
        gate, up = fc1_to_llama(state[f"{megatron}mlp.linear_fc1.bias"])
        out.update({
            f"{hf}self_attn.o_proj.bias": state[f"{megatron}self_attention.linear_proj.bias"],
            f"{hf}mlp.gate_proj.bias": gate, f"{hf}mlp.up_proj.bias": up,
            f"{hf}mlp.down_proj.bias": state[f"{megatron}mlp.linear_fc2.bias"],
        })
    return out


def megatron_to_llama(state: dict, shape: GPTShape) -> dict:
    """LlamaForCausalLM / Qwen2ForCausalLM / MixtralForCausalLM state dict from a full (TP=1, PP=1) GPTModel
    state dict; vocab rows trimmed to the tokenizer's. With tied embeddings `lm_head.weight` is left out (HF
    ties it)."""
    embedding = "embedding.word_embeddings.weight"
    out = {
        "model.embed_tokens.weight": trim_to_tokenizer(state[embedding], shape.vocab_size, embedding),
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if not shape.tied_embeddings:
        out["lm_head.weight"] = trim_to_tokenizer(state["output_layer.weight"], shape.vocab_size, "output_layer.weight")
    for i in range(shape.num_layers):
        out.update(_layer_to_llama(state, i, shape))
    return {key: value.contiguous() for key, value in out.items()}


def _layer_from_llama(hf_state: dict, i: int, shape: GPTShape) -> dict:
    megatron, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    attention = [hf_state[f"{hf}self_attn.{name}_proj.weight"] for name in ("q", "k", "v")]
    out = {
        f"{megatron}input_layernorm.weight": hf_state[f"{hf}input_layernorm.weight"],
        f"{megatron}pre_mlp_layernorm.weight": hf_state[f"{hf}post_attention_layernorm.weight"],
        f"{megatron}self_attention.linear_qkv.weight": qkv_from_llama(*attention, shape),
        f"{megatron}self_attention.linear_proj.weight": hf_state[f"{hf}self_attn.o_proj.weight"],
    }
    if shape.num_experts:
        out.update(moe_from_mixtral(hf_state, megatron, hf, shape))
    else:
        out[f"{megatron}mlp.linear_fc1.weight"] = fc1_from_llama(hf_state[f"{hf}mlp.gate_proj.weight"],
                                                                 hf_state[f"{hf}mlp.up_proj.weight"])
        out[f"{megatron}mlp.linear_fc2.weight"] = hf_state[f"{hf}mlp.down_proj.weight"]
    if shape.qkv_bias:
        biases = [hf_state[f"{hf}self_attn.{name}_proj.bias"] for name in ("q", "k", "v")]
        out[f"{megatron}self_attention.linear_qkv.bias"] = qkv_from_llama(*biases, shape)
    if shape.add_bias_linear:
        out[f"{megatron}self_attention.linear_proj.bias"] = hf_state[f"{hf}self_attn.o_proj.bias"]
        out[f"{megatron}mlp.linear_fc1.bias"] = fc1_from_llama(hf_state[f"{hf}mlp.gate_proj.bias"],
                                                               hf_state[f"{hf}mlp.up_proj.bias"])
        out[f"{megatron}mlp.linear_fc2.bias"] = hf_state[f"{hf}mlp.down_proj.bias"]
    return out


def llama_to_megatron(hf_state: dict, shape: GPTShape) -> dict:
    """Full GPTModel state dict (vocab rows as in the HF model, unpadded) from a Llama-family state dict."""
    out = {
        "embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf_state["model.norm.weight"],
    }
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    for i in range(shape.num_layers):
        out.update(_layer_from_llama(hf_state, i, shape))
    return out


def llama_config(shape: GPTShape, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json of the Llama-family model computing the same function as `shape`."""
    qwen2 = shape.add_qkv_bias and not shape.add_bias_linear
    model_type = "mixtral" if shape.num_experts else "qwen2" if qwen2 else "llama"
    config = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon,
        "rope_theta": shape.rotary_base,
        "rope_scaling": {"rope_type": "llama3", "factor": shape.rope_scaling_factor, **_LLAMA3_SCALING}
        if shape.use_rope_scaling else None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": shape.tied_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(shape.params_dtype).removeprefix("torch."),
    }
    if shape.num_experts:
        config.update(intermediate_size=shape.moe_ffn_hidden_size, num_local_experts=shape.num_experts,
                      num_experts_per_tok=shape.moe_router_topk, sliding_window=None, router_jitter_noise=0.0,
                      output_router_logits=False)
    elif qwen2:
        config.update(use_sliding_window=False, sliding_window=None)
    else:
        config.update(attention_bias=shape.add_bias_linear, mlp_bias=shape.add_bias_linear)
    return config


def _rope_scaling_args(config: dict) -> dict:
    scaling = config.get("rope_scaling")
    if not scaling:
        return dict(use_rope_scaling=False)
    kind = scaling.get("rope_type", scaling.get("type"))
    constants = {key: scaling.get(key) for key in _LLAMA3_SCALING}
    if kind != "llama3" or constants != _LLAMA3_SCALING:
        raise ValueError(f"config.json rope_scaling {scaling}: only Llama-3.1 scaling (rope_type llama3 with "
                         f"{_LLAMA3_SCALING}) is supported yet")
    return dict(use_rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))


def args_from_llama_config(config: dict) -> dict:
    """Megatron argument values (Namespace attribute names) of the GPT described by a Llama-family config.json."""
    model_type = config.get("model_type")
    if model_type not in IMPORTABLE_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r}: the Llama-family import reads "
                         f"{', '.join(IMPORTABLE_MODEL_TYPES)}")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        raise ValueError(f"config.json sliding_window {config['sliding_window']}: sliding-window attention is not "
                         "supported yet")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {config['hidden_act']!r}: the import knows SwiGLU (silu) only")
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError(f"config.json attention_bias {attention_bias}, mlp_bias {mlp_bias}: Megatron has biases on "
                         "every linear (--add-bias-linear) or on none")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    experts = {}
    if model_type == "mixtral":
        experts = dict(num_experts=config["num_local_experts"], moe_router_topk=config["num_experts_per_tok"],
                       moe_ffn_hidden_size=config["intermediate_size"], moe_layer_freq=1)
    return dict(**experts,
        num_layers=config["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        kv_channels=config.get("head_dim") or hidden // heads, ffn_hidden_size=config["intermediate_size"],
        group_query_attention=groups != heads, num_query_groups=groups, swiglu=True,
        add_bias_linear=attention_bias, add_qkv_bias=model_type == "qwen2" or attention_bias,
        normalization="RMSNorm", norm_epsilon=config.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
        rotary_base=config.get("rope_theta", 10000.0), max_position_embeddings=config["max_position_embeddings"],
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        bias_gelu_fusion=False, openai_gelu=False, **_rope_scaling_args(config),
    )
