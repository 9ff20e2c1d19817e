"""Megatron-Core `GPTModel` with multi-latent attention <-> Hugging Face `DeepseekV3ForCausalLM`.

Name map of layer N (Megatron `decoder.layers.N.` / HF `model.layers.N.`), one tensor each, no transform but
the SwiGLU split of fc1 (`fc1_to_llama`):

    self_attention.linear_q_down_proj   self_attn.q_a_proj            (or linear_q_proj = q_proj)
    self_attention.q_layernorm          self_attn.q_a_layernorm
    self_attention.linear_q_up_proj     self_attn.q_b_proj            rows per head [d_nope; d_rope], both
    self_attention.linear_kv_down_proj  self_attn.kv_a_proj_with_mqa  rows [kv_lora_rank; d_rope], both
    self_attention.kv_layernorm         self_attn.kv_a_layernorm
    self_attention.linear_kv_up_proj    self_attn.kv_b_proj           rows per head [d_nope; d_v], both
    self_attention.linear_proj          self_attn.o_proj
    mlp.router.weight / .expert_bias    mlp.gate.weight / .e_score_correction_bias
    mlp.experts.local_experts.E.linear_fc1 = [gate_proj; up_proj] of mlp.experts.E, linear_fc2 = down_proj
    mlp.shared_experts.*                mlp.shared_experts.*          (dense layers: mlp.* likewise)

Multi-token-prediction depth d (`mtp.layers.d.`) is DeepSeek's `model.layers.{L + d}.` (num_nextn_predict_layers
in config.json): enorm, hnorm, eh_proj, final_layernorm = shared_head.norm, and its transformer layer
(`mtp_model_layer.`) under the names above; `transformers` ignores these tensors, inference engines read them.

RoPE: HF's `rope_interleave=True` reorders the rotated channels from pairs to halves before rotating them,
which is what Megatron-Core's multi-latent attention does (`mla_rotary_interleaved`), so no weight is
permuted. YaRN maps to `rope_scaling` {"type": "yarn", factor, mscale, mscale_all_dim,
original_max_position_embeddings, beta_fast, beta_slow, truncate}, plus Megatron's concentration factor as
"attention_factor" where HF's own rule differs (mscale_all_dim 0); HF also scales the softmax by
mscale(factor, mscale_all_dim)^2, as Megatron does.

Routing: HF's router is sigmoid + e_score_correction_bias with n_group groups scored by the sum of their top-2
experts, top-k renormalised (norm_topk_prob) and times routed_scaling_factor. Megatron scores a group by its
top-(k / group_topk): the export needs k = 2 x group_topk with groups; without groups it writes n_group 1.
Megatron renormalises the sigmoid top-k for k > 1 only, so norm_topk_prob = (k > 1). A model without an
expert bias exports a zero bias (the same routing); every import has one (DeepSeek-V3 trains with it).
Layers: the first `first_k_dense_replace` are dense, the rest MoE, which is `--moe-layer-freq
[0]*k+[1]*(L-k)`. HF's latent norms use eps 1e-6 whatever rms_norm_eps says, so --norm-epsilon must be 1e-6.
"""

import math

import torch

from megatron.core.yarn import yarn_concentration_factor, yarn_get_mscale
from megatron.training.checkpointing.conversion.gpt_shape import GPTShape
from megatron.training.checkpointing.conversion.llama_hf import fc1_from_llama, fc1_to_llama
from megatron.training.checkpointing.conversion.vocab_padding import trim_to_tokenizer

_LATENT_NORM_EPS = 1e-6
_ATTENTION = {  # Megatron self_attention.<name>.weight -> HF self_attn.<name>.weight
    "linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
    "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
    "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj",
}


def _dense_prefix_length(shape: GPTShape) -> int | None:
    """k when the layers are k dense then MoE ([0]*k + [1]*(L-k)); L for a dense model; None otherwise."""
    if not shape.num_experts:
        return shape.num_layers
    k = shape.moe_layers.index(True) if any(shape.moe_layers) else shape.num_layers
    return k if all(shape.moe_layers[k:]) else None


def deepseek_v3_export_problems(shape: GPTShape) -> list[str]:
    """What DeepseekV3ForCausalLM cannot represent of `shape` (empty when it can)."""
    checks = (
        (shape.mla is None, "no --multi-latent-attention (DeepSeek-V3's attention)"),
        (shape.mla is not None and not shape.qk_layernorm, "no --qk-layernorm (DeepSeek-V3 has latent norms)"),
        (shape.normalization != "RMSNorm", f"--normalization {shape.normalization} (DeepSeek-V3 uses RMSNorm)"),
        (shape.norm_epsilon != _LATENT_NORM_EPS, f"--norm-epsilon {shape.norm_epsilon} (HF's latent norms use 1e-6)"),
        (not shape.swiglu, "no --swiglu"),
        (shape.add_bias_linear or shape.add_qkv_bias, "biases (DeepSeek-V3 has none)"),
        (_dense_prefix_length(shape) is None, "--moe-layer-freq other than dense layers first, then MoE layers"),
    )
    problems = [message for failed, message in checks if failed]
    mla = shape.mla
    if mla is not None and mla.rope_type == "rope":
        if shape.mla.rotary_scaling_factor > 1 and mla.mscale_all_dim:
            problems.append("--rope-type rope with --mscale-all-dim (HF scales the softmax with YaRN only)")
    if shape.num_experts:
        topk, groups, group_topk = shape.moe_router_topk, shape.moe_router_num_groups, shape.moe_router_group_topk
        moe_checks = (
            (shape.moe_router_score_function != "sigmoid", "a softmax router (DeepSeek-V3's is a sigmoid)"),
            (not shape.moe_shared_expert_intermediate_size or shape.moe_shared_expert_intermediate_size
             % shape.moe_ffn_hidden_size, "--moe-shared-expert-intermediate-size must be a multiple of "
             "--moe-ffn-hidden-size (DeepSeek-V3 has n_shared_experts of that width)"),
            (groups and group_topk < groups and topk != 2 * group_topk,
             f"--moe-router-topk {topk} with --moe-router-group-topk {group_topk} (HF scores a group by its top-2 "
             "experts: the top-k must be twice the group top-k)"),
        )
        problems += [message for failed, message in moe_checks if failed]
    return problems


def _layer_prefixes(shape: GPTShape) -> list[tuple[str, str, bool]]:
    """(Megatron prefix, HF prefix, MoE) of every transformer layer: the decoder's, then each multi-token-
    prediction depth's (DeepSeek's checkpoints hold depth d as model.layers.{L + d}, of the last layer's kind)."""
    moe = list(shape.moe_layers) or [False] * shape.num_layers
    layers = [(f"decoder.layers.{i}.", f"model.layers.{i}.", moe[i]) for i in range(shape.num_layers)]
    return layers + [(f"mtp.layers.{d}.mtp_model_layer.", f"model.layers.{shape.num_layers + d}.", moe[-1])
                     for d in range(shape.mtp_num_layers or 0)]


def _mtp_pairs(shape: GPTShape) -> list[tuple[str, str]]:
    """(Megatron key, HF key) of the depths' own tensors: enorm, hnorm, eh_proj ([h, 2h]: the embedding's half
    first, in both), final norm = shared_head.norm."""
    names = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "final_layernorm.weight": "shared_head.norm.weight"}
    return [(f"mtp.layers.{d}.{ours}", f"model.layers.{shape.num_layers + d}.{theirs}")
            for d in range(shape.mtp_num_layers or 0) for ours, theirs in names.items()]


def _layer_names(state_names, megatron: str, hf: str, moe: bool, shape: GPTShape) -> tuple[list, list]:
    """One layer's (Megatron key, HF key) pairs of tensors copied as they are, and its (Megatron MLP prefix, HF
    MLP prefix) pairs (fc1 = [gate_proj; up_proj], fc2 = down_proj); `state_names` are the Megatron-side key
    names (export) or the HF ones (import), to tell which optional attention tensors exist."""
    pairs = [(f"{megatron}input_layernorm.weight", f"{hf}input_layernorm.weight"),
             (f"{megatron}pre_mlp_layernorm.weight", f"{hf}post_attention_layernorm.weight")]
    for ours, theirs in _ATTENTION.items():
        pair = (f"{megatron}self_attention.{ours}.weight", f"{hf}self_attn.{theirs}.weight")
        if pair[0] in state_names or pair[1] in state_names:
            pairs.append(pair)
    if not moe:
        return pairs, [(f"{megatron}mlp", f"{hf}mlp")]
    pairs += [(f"{megatron}mlp.router.weight", f"{hf}mlp.gate.weight"),
              (f"{megatron}mlp.router.expert_bias", f"{hf}mlp.gate.e_score_correction_bias")]
    mlps = [(f"{megatron}mlp.experts.local_experts.{e}", f"{hf}mlp.experts.{e}") for e in range(shape.num_experts)]
    return pairs, mlps + [(f"{megatron}mlp.shared_experts", f"{hf}mlp.shared_experts")]


def megatron_to_deepseek_v3(state: dict, shape: GPTShape) -> dict:
    """DeepseekV3ForCausalLM state dict of a full (TP=1, PP=1) GPTModel state dict; vocab rows trimmed to the
    tokenizer's; with tied embeddings `lm_head.weight` is left out (HF ties it). Multi-token-prediction depths
    go where DeepSeek's checkpoints keep them, with their copies of the embedding and output weight
    (`embed_tokens`, `shared_head.head`); `transformers` does not load them."""
    embedding, output = "embedding.word_embeddings.weight", "output_layer.weight"
    words = trim_to_tokenizer(state[embedding], shape.vocab_size, embedding)
    head = words if shape.tied_embeddings else trim_to_tokenizer(state[output], shape.vocab_size, output)
    out = {"model.embed_tokens.weight": words, "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not shape.tied_embeddings:
        out["lm_head.weight"] = head
    for megatron, hf, moe in _layer_prefixes(shape):
        pairs, mlps = _layer_names(state, megatron, hf, moe, shape)
        for ours, theirs in pairs:
            if ours.endswith("expert_bias"):  # without an expert bias: zeros, the same routing
                out[theirs] = state[ours].float() if ours in state else torch.zeros(shape.num_experts)
            else:
                out[theirs] = state[ours]
        for ours, theirs in mlps:
            gate, up = fc1_to_llama(state[f"{ours}.linear_fc1.weight"])
            out.update({f"{theirs}.gate_proj.weight": gate, f"{theirs}.up_proj.weight": up,
                        f"{theirs}.down_proj.weight": state[f"{ours}.linear_fc2.weight"]})
    out.update({theirs: state[ours] for ours, theirs in _mtp_pairs(shape)})
    for depth in range(shape.mtp_num_layers or 0):
        prefix = f"model.layers.{shape.num_layers + depth}."
        out.update({f"{prefix}embed_tokens.weight": words.clone(), f"{prefix}shared_head.head.weight": head.clone()})
    return {key: value.contiguous() for key, value in out.items()}


def deepseek_v3_to_megatron(hf_state: dict, shape: GPTShape) -> dict:
    """Full GPTModel state dict (vocab rows as in the HF model) of a DeepseekV3ForCausalLM state dict (the
    depths' copies of the embedding and output weight are the model's own, not read)."""
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    for megatron, hf, moe in _layer_prefixes(shape):
        pairs, mlps = _layer_names(hf_state, megatron, hf, moe, shape)
        out.update({ours: hf_state[theirs].float() if ours.endswith("expert_bias") else hf_state[theirs]
                    for ours, theirs in pairs})
        for ours, theirs in mlps:
            out[f"{ours}.linear_fc1.weight"] = fc1_from_llama(hf_state[f"{theirs}.gate_proj.weight"],
                                                              hf_state[f"{theirs}.up_proj.weight"])
            out[f"{ours}.linear_fc2.weight"] = hf_state[f"{theirs}.down_proj.weight"]
    out.update({ours: hf_state[theirs] for ours, theirs in _mtp_pairs(shape)})
    return out


def _hf_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """HF's own YaRN concentration: mscale(s, mscale) / mscale(s, mscale_all_dim) when both are non-zero, else
    mscale(s) (where Megatron-Core still takes the ratio, which with mscale_all_dim 0 is mscale(s, mscale))."""
    if mscale and mscale_all_dim:
        return yarn_concentration_factor(factor, mscale, mscale_all_dim)
    return yarn_get_mscale(factor)


def _rope_scaling(shape: GPTShape) -> dict | None:
    mla = shape.mla
    if mla.rope_type == "rope":
        return None
    scaling = {"type": "yarn", "rope_type": "yarn", "factor": mla.rotary_scaling_factor, "mscale": mla.mscale,
               "mscale_all_dim": mla.mscale_all_dim,
               "original_max_position_embeddings": mla.original_max_position_embeddings,
               "beta_fast": mla.beta_fast, "beta_slow": mla.beta_slow, "truncate": mla.correction_range_round_to_int}
    ours = yarn_concentration_factor(mla.rotary_scaling_factor, mla.mscale, mla.mscale_all_dim)
    if ours != _hf_attention_factor(mla.rotary_scaling_factor, mla.mscale, mla.mscale_all_dim):
        scaling["attention_factor"] = ours
    return scaling


def deepseek_v3_config(shape: GPTShape, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json of the DeepseekV3ForCausalLM computing the same function as `shape`."""
    mla, experts = shape.mla, shape.num_experts
    moe_width = shape.moe_ffn_hidden_size if experts else shape.ffn_hidden_size
    grouped = bool(experts and shape.moe_router_num_groups)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "moe_intermediate_size": moe_width, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_attention_heads,
        "n_shared_experts": shape.moe_shared_expert_intermediate_size // moe_width if experts else 1,
        "n_routed_experts": experts or 1, "num_experts_per_tok": shape.moe_router_topk if experts else 1,
        "routed_scaling_factor": shape.moe_router_topk_scaling_factor or 1.0,
        "n_group": shape.moe_router_num_groups if grouped else 1,
        "topk_group": shape.moe_router_group_topk if grouped else 1,
        "first_k_dense_replace": _dense_prefix_length(shape),
        "norm_topk_prob": bool(experts) and shape.moe_router_topk > 1,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_head_dim,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim, "v_head_dim": mla.v_head_dim, "rope_interleave": True,
        "hidden_act": "silu", "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon, "rope_theta": shape.rotary_base, "rope_scaling": _rope_scaling(shape),
        "num_nextn_predict_layers": shape.mtp_num_layers or 0,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": shape.tied_embeddings,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "torch_dtype": str(shape.params_dtype).removeprefix("torch."),
    }


def _rope_args(config: dict) -> dict:
    scaling = config.get("rope_scaling")
    if not scaling:
        return dict(rope_type="rope")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"config.json rope_scaling {scaling}: DeepSeek-V3's import knows yarn scaling only")
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = float(scaling.get("mscale") or 1.0), float(scaling.get("mscale_all_dim") or 0.0)
    theirs = scaling.get("attention_factor") or _hf_attention_factor(factor, mscale, mscale_all_dim)
    if not math.isclose(theirs, yarn_concentration_factor(factor, mscale, mscale_all_dim), rel_tol=1e-9):
        raise ValueError(f"config.json rope_scaling {scaling}: its attention factor {theirs} is not Megatron's "
                         "mscale(factor, mscale) / mscale(factor, mscale_all_dim), which is not supported yet")
    return dict(rope_type="yarn", rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim,
                yarn_original_max_position_embeddings=scaling.get("original_max_position_embeddings")
                or config["max_position_embeddings"],
                yarn_beta_fast=float(scaling.get("beta_fast") or 32), yarn_beta_slow=float(scaling.get("beta_slow") or 1),
                yarn_correction_range_round_to_int=scaling.get("truncate", True))


def _moe_args(config: dict, num_layers: int) -> dict:
    dense = min(config.get("first_k_dense_replace", 0), num_layers)
    if dense == num_layers:
        return {}
    topk, groups, group_topk = config["num_experts_per_tok"], config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1 and group_topk < groups and topk != 2 * group_topk:
        raise ValueError(f"config.json num_experts_per_tok {topk}, topk_group {group_topk}: HF scores a group by its "
                         "top-2 experts, Megatron by its top-(k / group_topk); they agree for k = 2 x topk_group only")
    if bool(config.get("norm_topk_prob", True)) != (topk > 1):
        raise ValueError(f"config.json norm_topk_prob {config.get('norm_topk_prob')} with num_experts_per_tok {topk}: "
                         "Megatron renormalises the top-k sigmoid scores exactly when k > 1")
    width = config["moe_intermediate_size"]
    return dict(num_experts=config["n_routed_experts"], moe_ffn_hidden_size=width,
                moe_shared_expert_intermediate_size=width * config.get("n_shared_experts", 1),
                moe_layer_freq=[0] * dense + [1] * (num_layers - dense), moe_router_topk=topk,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=group_topk if groups > 1 else None,
                moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))


def args_from_deepseek_v3_config(config: dict) -> dict:
    """Megatron argument values (Namespace attribute names) of the GPT described by a DeepseekV3 config.json."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {config['hidden_act']!r}: the import knows SwiGLU (silu) only")
    if config.get("attention_bias", False):
        raise ValueError("config.json attention_bias true: biases in multi-latent attention are not supported yet")
    if not config.get("rope_interleave", True):
        raise ValueError("config.json rope_interleave false: only DeepSeek's interleaved rotary channels are "
                         "supported yet")
    if config.get("rms_norm_eps", 1e-6) != _LATENT_NORM_EPS:
        raise ValueError(f"config.json rms_norm_eps {config['rms_norm_eps']}: HF's latent norms use 1e-6 and "
                         "Megatron's one --norm-epsilon cannot hold both")
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"config.json num_key_value_heads {config['num_key_value_heads']}: multi-latent attention "
                         f"has one key/value head per query head ({heads})")
    return dict(
        **_moe_args(config, layers), **_rope_args(config),
        num_layers=layers, hidden_size=config["hidden_size"], num_attention_heads=heads,
        mtp_num_layers=config.get("num_nextn_predict_layers") or None,
        ffn_hidden_size=config["intermediate_size"], multi_latent_attention=True, q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"], qk_head_dim=config["qk_nope_head_dim"],
        qk_pos_emb_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"], qk_layernorm=True,
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, normalization="RMSNorm",
        norm_epsilon=config.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
        rotary_base=config.get("rope_theta", 10000.0), max_position_embeddings=config["max_position_embeddings"],
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        bias_gelu_fusion=False, openai_gelu=False,
    )
