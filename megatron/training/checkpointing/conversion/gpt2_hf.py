"""Megatron-Core `GPTModel` state dict <-> Hugging Face `GPT2LMHeadModel` (reference 8.4, the HF GPT-2 path).

One function per transform:

    qkv_to_gpt2 / qkv_from_gpt2   Megatron rows [np, 3, hn] (q0 k0 v0 q1 ...) <-> c_attn columns [3, np, hn]
    conv1d                        GPT-2's Conv1D stores Linear weights transposed: [in, out]
    trim_to_tokenizer             padded vocabulary rows dropped (vocab_padding.py)

GPT-2 is LayerNorm, learned positions, multi-head attention, biases everywhere, a tied `lm_head`;
`attn.bias` (the causal-mask buffer) is not a weight and is neither written nor read. The GELU variant
follows the training flags: Megatron's fused bias-GELU and --openai-gelu compute the tanh form, which
is HF's `gelu_new`; otherwise the exact `gelu`.
"""

import torch

from megatron.training.checkpointing.conversion.gpt_shape import GPTShape
from megatron.training.checkpointing.conversion.vocab_padding import trim_to_tokenizer

# (Megatron-Core name in decoder.layers.N, GPT-2 name in transformer.h.N) of the Conv1D linears.
_CONV1D_LINEARS = (
    ("self_attention.linear_proj", "attn.c_proj"),
    ("mlp.linear_fc1", "mlp.c_fc"),
    ("mlp.linear_fc2", "mlp.c_proj"),
)
_NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))


def gpt2_export_problems(shape: GPTShape) -> list[str]:
    """What a GPT2LMHeadModel cannot represent of `shape` (empty when it can)."""
    checks = (
        (shape.normalization != "LayerNorm", f"--normalization {shape.normalization} (GPT-2 uses LayerNorm)"),
        (shape.position_embedding_type != "learned_absolute",
         f"--position-embedding-type {shape.position_embedding_type} (GPT-2 learns absolute positions)"),
        (shape.num_query_groups != shape.num_attention_heads, "--group-query-attention (GPT-2 is multi-head)"),
        (shape.swiglu, "--swiglu (GPT-2 has a GELU MLP)"),
        (shape.num_experts is not None, "--num-experts (GPT-2 has a dense MLP)"),
        (not shape.add_bias_linear, "--disable-bias-linear (GPT-2 has biases)"),
        (not shape.tied_embeddings, "--untie-embeddings-and-output-weights (GPT-2 ties lm_head to wte)"),
        (shape.kv_channels * shape.num_attention_heads != shape.hidden_size,
         f"--kv-channels {shape.kv_channels} (GPT-2 heads are hidden_size / heads wide)"),
    )
    return [message for failed, message in checks if failed]


def conv1d(weight: torch.Tensor) -> torch.Tensor:
    """Linear [out, in] <-> Conv1D [in, out] (the same transpose both ways)."""
    return weight.t().contiguous()


def qkv_to_gpt2(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`linear_qkv` weight [np*3*hn, h] (or bias [np*3*hn]) -> `c_attn` weight [h, 3*np*hn] (or bias).

    Rows [np, 3, hn] are regrouped to [3, np, hn] (all queries, all keys, all values), then the weight is
    transposed for Conv1D.
    """
    rest = qkv.shape[1:]
    columns = qkv.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(qkv.shape[0], *rest)
    return conv1d(columns) if qkv.dim() == 2 else columns.contiguous()


def qkv_from_gpt2(c_attn: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`c_attn` weight [h, 3*np*hn] (or bias) -> `linear_qkv` rows [np, 3, hn] flattened (inverse of qkv_to_gpt2)."""
    rows = conv1d(c_attn) if c_attn.dim() == 2 else c_attn
    rest = rows.shape[1:]
    return rows.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(rows.shape[0], *rest).contiguous()


def megatron_to_gpt2(state: dict, shape: GPTShape) -> dict:
    """GPT2LMHeadModel state dict from a full (TP=1, PP=1) GPTModel state dict; vocab rows trimmed to the
    tokenizer's. `lm_head.weight` is left out: it is tied to `transformer.wte.weight`."""
    out = {
        "transformer.wte.weight": trim_to_tokenizer(state["embedding.word_embeddings.weight"], shape.vocab_size,
                                                    "embedding.word_embeddings.weight"),
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
    }
    for i in range(shape.num_layers):
        megatron, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for megatron_norm, hf_norm in _NORMS:
            for suffix in ("weight", "bias"):
                out[f"{hf}{hf_norm}.{suffix}"] = state[f"{megatron}{megatron_norm}.{suffix}"]
        for suffix in ("weight", "bias"):
            out[f"{hf}attn.c_attn.{suffix}"] = qkv_to_gpt2(
                state[f"{megatron}self_attention.linear_qkv.{suffix}"], shape.num_attention_heads
            )
        for megatron_linear, hf_linear in _CONV1D_LINEARS:
            out[f"{hf}{hf_linear}.weight"] = conv1d(state[f"{megatron}{megatron_linear}.weight"])
            out[f"{hf}{hf_linear}.bias"] = state[f"{megatron}{megatron_linear}.bias"]
    return {key: value.contiguous() for key, value in out.items()}


def gpt2_to_megatron(hf_state: dict, shape: GPTShape) -> dict:
    """Full GPTModel state dict (vocab rows as in the HF model, unpadded) from a GPT2LMHeadModel state dict."""
    out = {
        "embedding.word_embeddings.weight": hf_state["transformer.wte.weight"],
        "embedding.position_embeddings.weight": hf_state["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": hf_state["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": hf_state["transformer.ln_f.bias"],
    }
    for i in range(shape.num_layers):
        megatron, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for megatron_norm, hf_norm in _NORMS:
            for suffix in ("weight", "bias"):
                out[f"{megatron}{megatron_norm}.{suffix}"] = hf_state[f"{hf}{hf_norm}.{suffix}"]
        for suffix in ("weight", "bias"):
            out[f"{megatron}self_attention.linear_qkv.{suffix}"] = qkv_from_gpt2(
                hf_state[f"{hf}attn.c_attn.{suffix}"], shape.num_attention_heads
            )
        for megatron_linear, hf_linear in _CONV1D_LINEARS:
            out[f"{megatron}{megatron_linear}.weight"] = conv1d(hf_state[f"{hf}{hf_linear}.weight"])
            out[f"{megatron}{megatron_linear}.bias"] = hf_state[f"{hf}{hf_linear}.bias"]
    return out


def gpt2_config(shape: GPTShape, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json of the GPT2LMHeadModel computing the same function as `shape`."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": shape.vocab_size,
        "n_positions": shape.max_position_embeddings,
        "n_embd": shape.hidden_size,
        "n_layer": shape.num_layers,
        "n_head": shape.num_attention_heads,
        "n_inner": shape.ffn_hidden_size,
        "activation_function": shape.gelu,
        "layer_norm_epsilon": shape.norm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(shape.params_dtype).removeprefix("torch."),
    }


def args_from_gpt2_config(config: dict) -> dict:
    """Megatron argument values (Namespace attribute names) of the GPT described by a GPT-2 config.json."""
    hidden, heads = config["n_embd"], config["n_head"]
    activation = config.get("activation_function", "gelu_new")
    if activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise ValueError(f"config.json activation_function {activation!r}: Megatron's GPT MLP computes gelu (exact) "
                         "or the tanh approximation (gelu_new)")
    tanh_gelu = activation != "gelu"
    return dict(
        num_layers=config["n_layer"], hidden_size=hidden, num_attention_heads=heads, kv_channels=hidden // heads,
        ffn_hidden_size=config.get("n_inner") or 4 * hidden, group_query_attention=False, num_query_groups=heads,
        swiglu=False, add_bias_linear=True, add_qkv_bias=False, normalization="LayerNorm",
        norm_epsilon=config.get("layer_norm_epsilon", 1e-5), position_embedding_type="learned_absolute",
        max_position_embeddings=config["n_positions"], untie_embeddings_and_output_weights=False,
        # The tanh GELU is Megatron's fused bias-GELU; the exact one needs the fusion off.
        bias_gelu_fusion=tanh_gelu, openai_gelu=False,
    )
