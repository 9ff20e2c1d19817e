"""Megatron-Core `GPTModel` with per-head q/k norms and experts <-> Hugging Face `Qwen3MoeForCausalLM`.

Qwen3-MoE is Mixtral's layout with three differences: RMSNorm of every query and key head before RoPE
(`--qk-layernorm`: self_attention.q_layernorm / k_layernorm = self_attn.q_norm / k_norm, [head_dim] each),
an explicit head_dim (`--kv-channels`), and dense layers where `mlp_only_layers` or `decoder_sparse_step`
say (`--moe-layer-freq` pattern; here decoder_sparse_step is 1 and mlp_only_layers lists the dense layers).
Attention: the per-group interleaved QKV rows split into q_proj / k_proj / v_proj as for Llama
(`qkv_to_llama`). Experts: mlp.gate.weight = router.weight [E, h]; expert e's linear_fc1 = [gate_proj;
up_proj], linear_fc2 = down_proj. Routing: HF takes the top-k of softmax(logits) and, with norm_topk_prob,
renormalises them - Megatron's default router (softmax over the top-k logits); without it, Megatron's
--moe-router-pre-softmax. No shared experts, no expert bias, no group-limited routing.
"""

from megatron.training.checkpointing.conversion.gpt_shape import GPTShape
from megatron.training.checkpointing.conversion.llama_hf import (
    fc1_from_llama,
    fc1_to_llama,
    qkv_from_llama,
    qkv_to_llama,
)
from megatron.training.checkpointing.conversion.vocab_padding import trim_to_tokenizer


def qwen3_moe_export_problems(shape: GPTShape) -> list[str]:
    """What Qwen3MoeForCausalLM cannot represent of `shape` (empty when it can)."""
    checks = (
        (not shape.num_experts, "no --num-experts (Qwen3-MoE has experts)"),
        (not shape.qk_layernorm, "no --qk-layernorm (Qwen3 normalises each query and key head)"),
        (shape.mla is not None, "--multi-latent-attention"),
        (shape.normalization != "RMSNorm", f"--normalization {shape.normalization} (Qwen3 uses RMSNorm)"),
        (shape.position_embedding_type != "rope", f"--position-embedding-type {shape.position_embedding_type}"),
        (shape.use_rope_scaling, "--use-rope-scaling (Llama-3.1 scaling)"),
        (not shape.swiglu, "no --swiglu"),
        (shape.add_bias_linear or shape.add_qkv_bias, "biases (Qwen3-MoE's attention_bias also biases o_proj)"),
        (shape.mtp_num_layers, "--mtp-num-layers (Qwen3-MoE has no multi-token prediction layers)"),
        (shape.moe_shared_expert_intermediate_size, "--moe-shared-expert-intermediate-size (no shared experts)"),
        (shape.moe_router_score_function != "softmax", "a sigmoid router (Qwen3-MoE's is a softmax)"),
        (shape.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (shape.moe_router_num_groups, "--moe-router-num-groups (group-limited routing)"),
        (shape.moe_router_topk_scaling_factor not in (None, 1.0), "--moe-router-topk-scaling-factor"),
    )
    return [message for failed, message in checks if failed]


def _layer_names(i: int, shape: GPTShape) -> tuple[list, list]:
    """Layer i's (Megatron key, HF key) pairs copied as they are, and its (Megatron MLP, HF MLP) prefixes."""
    megatron, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    pairs = [(f"{megatron}input_layernorm.weight", f"{hf}input_layernorm.weight"),
             (f"{megatron}pre_mlp_layernorm.weight", f"{hf}post_attention_layernorm.weight"),
             (f"{megatron}self_attention.linear_proj.weight", f"{hf}self_attn.o_proj.weight"),
             (f"{megatron}self_attention.q_layernorm.weight", f"{hf}self_attn.q_norm.weight"),
             (f"{megatron}self_attention.k_layernorm.weight", f"{hf}self_attn.k_norm.weight")]
    if not shape.moe_layers[i]:
        return pairs, [(f"{megatron}mlp", f"{hf}mlp")]
    pairs.append((f"{megatron}mlp.router.weight", f"{hf}mlp.gate.weight"))
    return pairs, [(f"{megatron}mlp.experts.local_experts.{e}", f"{hf}mlp.experts.{e}") for e in range(shape.num_experts)]


def megatron_to_qwen3_moe(state: dict, shape: GPTShape) -> dict:
    """Qwen3MoeForCausalLM state dict of a full (TP=1, PP=1) GPTModel state dict, vocab rows trimmed to the
    tokenizer's (`lm_head.weight` left out with tied embeddings)."""
    embedding = "embedding.word_embeddings.weight"
    out = {"model.embed_tokens.weight": trim_to_tokenizer(state[embedding], shape.vocab_size, embedding),
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not shape.tied_embeddings:
        out["lm_head.weight"] = trim_to_tokenizer(state["output_layer.weight"], shape.vocab_size, "output_layer.weight")
    for i in range(shape.num_layers):
        pairs, mlps = _layer_names(i, shape)
        out.update({theirs: state[ours] for ours, theirs in pairs})
        q, k, v = qkv_to_llama(state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], shape)
        out.update({f"model.layers.{i}.self_attn.{name}_proj.weight": tensor for name, tensor in zip("qkv", (q, k, v))})
        for ours, theirs in mlps:
            gate, up = fc1_to_llama(state[f"{ours}.linear_fc1.weight"])
            out.update({f"{theirs}.gate_proj.weight": gate, f"{theirs}.up_proj.weight": up,
                        f"{theirs}.down_proj.weight": state[f"{ours}.linear_fc2.weight"]})
    return {key: value.contiguous() for key, value in out.items()}


def qwen3_moe_to_megatron(hf_state: dict, shape: GPTShape) -> dict:
    """Full GPTModel state dict (vocab rows as in the HF model) of a Qwen3MoeForCausalLM state dict."""
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    for i in range(shape.num_layers):
        pairs, mlps = _layer_names(i, shape)
        out.update({ours: hf_state[theirs] for ours, theirs in pairs})
        attention = [hf_state[f"model.layers.{i}.self_attn.{name}_proj.weight"] for name in "qkv"]
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = qkv_from_llama(*attention, shape)
        for ours, theirs in mlps:
            out[f"{ours}.linear_fc1.weight"] = fc1_from_llama(hf_state[f"{theirs}.gate_proj.weight"],
                                                              hf_state[f"{theirs}.up_proj.weight"])
            out[f"{ours}.linear_fc2.weight"] = hf_state[f"{theirs}.down_proj.weight"]
    return out


def qwen3_moe_config(shape: GPTShape, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json of the Qwen3MoeForCausalLM computing the same function as `shape`."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "moe_intermediate_size": shape.moe_ffn_hidden_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.kv_channels, "num_experts": shape.num_experts, "num_experts_per_tok": shape.moe_router_topk,
        "norm_topk_prob": not shape.moe_router_pre_softmax, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, is_moe in enumerate(shape.moe_layers) if not is_moe],
        "hidden_act": "silu", "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon, "rope_theta": shape.rotary_base, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "output_router_logits": False, "tie_word_embeddings": shape.tied_embeddings,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "torch_dtype": str(shape.params_dtype).removeprefix("torch."),
    }


def args_from_qwen3_moe_config(config: dict) -> dict:
    """Megatron argument values (Namespace attribute names) of the GPT described by a Qwen3-MoE config.json."""
    problems = [f"{key} {config.get(key)!r}: {why}" for key, bad, why in (
        ("hidden_act", config.get("hidden_act", "silu") != "silu", "the import knows SwiGLU (silu) only"),
        ("attention_bias", config.get("attention_bias", False), "biases are not supported yet"),
        ("use_sliding_window", config.get("use_sliding_window", False), "sliding-window attention is not supported yet"),
        ("rope_scaling", config.get("rope_scaling"), "RoPE scaling for Qwen3-MoE is not supported yet"),
    ) if bad]
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
    layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    groups, step, dense = config.get("num_key_value_heads") or heads, config.get("decoder_sparse_step", 1), \
        set(config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and config["num_experts"] > 0 and (i + 1) % step == 0) for i in range(layers)]
    return dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=config["intermediate_size"],
        kv_channels=config.get("head_dim") or hidden // heads, group_query_attention=groups != heads,
        num_query_groups=groups, qk_layernorm=True, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        normalization="RMSNorm", norm_epsilon=config.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
        rotary_base=config.get("rope_theta", 10000.0), max_position_embeddings=config["max_position_embeddings"],
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        num_experts=config["num_experts"], moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_router_topk=config["num_experts_per_tok"], moe_layer_freq=pattern,
        moe_router_pre_softmax=not config.get("norm_topk_prob", False), bias_gelu_fusion=False, openai_gelu=False,
    )
