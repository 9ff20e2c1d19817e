"""What a GPT checkpoint conversion needs to know about the model, read once from the training arguments.

The shape decides every transform: how the fused QKV rows are grouped (heads, query groups, head
width), whether `linear_fc1` holds [gate; up] (SwiGLU), which tensors exist (biases, position
embeddings, an untied output layer, a router and routed experts in the MoE layers), and how many
vocabulary rows are real (`vocab_size`) versus padding (`padded_vocab_size`, reference 12 item 11).
"""

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentAttentionShape:
    """Multi-latent attention (--multi-latent-attention): the latent and head widths and the RoPE flavour."""

    q_lora_rank: int | None  # None: queries projected directly (linear_q_proj)
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_type: str  # "rope" or "yarn"
    rotary_scaling_factor: float
    mscale: float
    mscale_all_dim: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    correction_range_round_to_int: bool


@dataclass(frozen=True)
class GPTShape:
    """The architecture of a Megatron-Core `GPTModel`, in the names of Megatron's arguments."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # = num_attention_heads without grouped-query attention
    kv_channels: int  # head width hn
    ffn_hidden_size: int
    swiglu: bool  # linear_fc1 = [gate; up], SiLU on the gate
    add_bias_linear: bool
    add_qkv_bias: bool
    normalization: str  # "LayerNorm" or "RMSNorm"
    norm_epsilon: float
    position_embedding_type: str  # "learned_absolute" or "rope"
    max_position_embeddings: int
    rotary_base: float
    use_rope_scaling: bool  # Llama-3.1 frequency scaling
    rope_scaling_factor: float
    tied_embeddings: bool
    gelu: str  # Hugging Face's name of the GELU variant: "gelu" (erf) or "gelu_new" (tanh)
    vocab_size: int | None  # the tokenizer's, without padding rows; None when unknown
    padded_vocab_size: int
    params_dtype: torch.dtype
    # Mixture of experts: the routed experts of each MoE layer (router + E SwiGLU/GELU MLPs), else None.
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False  # top-k of the softmax over all experts, not renormalised
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or dense MLP; empty without experts
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_enable_expert_bias: bool = False  # routers hold `expert_bias` (aux-loss-free balancing)
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    qk_layernorm: bool = False  # per-head q/k norms, or with `mla` the norms of the q and kv latents
    mla: LatentAttentionShape | None = None
    mtp_num_layers: int | None = None

    @property
    def qkv_bias(self) -> bool:
        """`linear_qkv` has a bias with --add-bias-linear or --add-qkv-bias (Qwen2)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def norm_has_bias(self) -> bool:
        return self.normalization == "LayerNorm"


def _gelu_variant(args) -> str:
    """Megatron's fused bias-GELU and --openai-gelu compute the tanh approximation; otherwise exact GELU."""
    if getattr(args, "openai_gelu", False) or (args.bias_gelu_fusion and args.add_bias_linear):
        return "gelu_new"
    return "gelu"


def _expert_tensor_parallel_size(args) -> int:
    return getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size


def _unsupported_features(args) -> list[str]:
    """Settings whose weights the GPT conversions cannot express, one message each."""
    problems = []
    checks = (
        (getattr(args, "num_experts", None) and getattr(args, "add_bias_linear", False),
         "biases in experts (--add-bias-linear with --num-experts)"),
        (getattr(args, "num_experts", None) and _expert_tensor_parallel_size(args) != args.tensor_model_parallel_size,
         "--expert-tensor-parallel-size other than --tensor-model-parallel-size"),
        (getattr(args, "layernorm_zero_centered_gamma", False), "--apply-layernorm-1p"),
        (getattr(args, "squared_relu", False), "--squared-relu"),
        (getattr(args, "quick_geglu", False), "--quick-geglu"),
        (getattr(args, "rotary_interleaved", False), "--rotary-interleaved"),
        (getattr(args, "rotary_percent", 1.0) != 1.0, f"--rotary-percent {getattr(args, 'rotary_percent', 1.0)}"),
        (getattr(args, "apply_residual_connection_post_layernorm", False),
         "--apply-residual-connection-post-layernorm"),
        ((getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1,
         "--num-layers-per-virtual-pipeline-stage (virtual pipeline stages)"),
        (getattr(args, "decoder_first_pipeline_num_layers", None) is not None
         or getattr(args, "decoder_last_pipeline_num_layers", None) is not None,
         "--decoder-first/last-pipeline-num-layers (uneven pipeline stages)"),
        (getattr(args, "pipeline_model_parallel_layout", None) is not None
         or getattr(args, "account_for_embedding_in_pipeline_split", False)
         or getattr(args, "account_for_loss_in_pipeline_split", False),
         "--pipeline-model-parallel-layout / --account-for-embedding/loss-in-pipeline-split (uneven pipeline stages)"),
        (getattr(args, "experimental_attention_variant", None), "--experimental-attention-variant (linear attention)"),
        (getattr(args, "attention_output_gate", False), "--attention-output-gate"),
        (getattr(args, "moe_shared_expert_gate", False), "--moe-shared-expert-gate"),
    )
    for present, flag in checks:
        if present:
            problems.append(f"{flag} is not supported yet by the GPT checkpoint conversion")
    if args.position_embedding_type not in ("learned_absolute", "rope"):
        problems.append(f"--position-embedding-type {args.position_embedding_type}: the conversion knows "
                        "learned_absolute and rope")
    if args.normalization not in ("LayerNorm", "RMSNorm"):
        problems.append(f"--normalization {args.normalization}: the conversion knows LayerNorm and RMSNorm")
    return problems


def _moe_layers(args) -> tuple[bool, ...]:
    """Which layers are MoE under `--moe-layer-freq` (N: layers 0, N, 2N, ...; or a 0/1 list); () when dense."""
    if not getattr(args, "num_experts", None):
        return ()
    frequency = getattr(args, "moe_layer_freq", 1)
    if isinstance(frequency, int):
        return tuple(layer % frequency == 0 for layer in range(args.num_layers))
    return tuple(bool(is_moe) for is_moe in frequency)


def _latent_attention_shape(args) -> LatentAttentionShape | None:
    """The MLA widths and RoPE of `args` (the YaRN fields of multi-latent attention, mla_mtp.py), or None."""
    if not getattr(args, "multi_latent_attention", False):
        return None

    def unset_as(name, default):
        value = getattr(args, name, None)
        return default if value is None else value

    return LatentAttentionShape(
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        rope_type=unset_as("rope_type", "yarn"), rotary_scaling_factor=float(args.rotary_scaling_factor),
        mscale=float(args.mscale), mscale_all_dim=float(args.mscale_all_dim),
        original_max_position_embeddings=unset_as("yarn_original_max_position_embeddings", 4096),
        beta_fast=float(unset_as("yarn_beta_fast", 32.0)), beta_slow=float(unset_as("yarn_beta_slow", 1.0)),
        correction_range_round_to_int=unset_as("yarn_correction_range_round_to_int", True),
    )


def gpt_shape_from_args(args: argparse.Namespace, vocab_size: int | None) -> GPTShape:
    """The shape of the GPT trained with `args` (a checkpoint's validated Namespace); `vocab_size` is the
    tokenizer's (None when unknown). Raises one ValueError listing every setting the conversion cannot
    express."""
    problems = _unsupported_features(args)
    if vocab_size is not None and vocab_size > args.padded_vocab_size:
        problems.append(f"the tokenizer has {vocab_size} ids but the model only {args.padded_vocab_size} vocabulary "
                        "rows: --true-vocab-size (or the tokenizer files) do not belong to this checkpoint")
    if problems:
        raise ValueError("this GPT checkpoint cannot be converted:\n  - " + "\n  - ".join(problems))
    heads = args.num_attention_heads
    return GPTShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or args.hidden_size // heads,
        ffn_hidden_size=args.ffn_hidden_size,
        swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        normalization=args.normalization,
        norm_epsilon=args.layernorm_epsilon,
        position_embedding_type=args.position_embedding_type,
        max_position_embeddings=args.max_position_embeddings,
        rotary_base=float(getattr(args, "rotary_base", 10000)),
        use_rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)),
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        gelu=_gelu_variant(args),
        vocab_size=vocab_size,
        padded_vocab_size=args.padded_vocab_size,
        params_dtype=getattr(args, "params_dtype", torch.float32),
        num_experts=getattr(args, "num_experts", None),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
        moe_router_topk=getattr(args, "moe_router_topk", 2),
        moe_router_score_function=getattr(args, "moe_router_score_function", "softmax"),
        moe_router_pre_softmax=getattr(args, "moe_router_pre_softmax", False),
        moe_layers=_moe_layers(args),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        moe_router_enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
        moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
        moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        mla=_latent_attention_shape(args),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
    )
