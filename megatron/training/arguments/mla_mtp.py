"""Flags of DeepSeek-V3-style models: multi-latent attention with YaRN, multi-token prediction, and the
group-limited MoE routing flags (Megatron-LM's `_add_mla_args`, `--rope-type`, the `--yarn-*` flags and the
TransformerConfig-generated `--multi-latent-attention`, `--mtp-*`, `--moe-router-*` flags).

    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32

Departure: Megatron-LM applies `--yarn-original-max-position-embeddings`, `--yarn-beta-fast/slow` and
`--[no-]yarn-correction-range-round-to-int` to `--position-embedding-type yarn` only, so with multi-latent
attention they silently keep their defaults (4096, 32, 1, rounded); here they set the YaRN of multi-latent
attention (standard attention with YaRN is not supported yet).
"""

import argparse

_YARN_FIELDS = {  # MLATransformerConfig field <- flag dest
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "correction_range_round_to_int": "yarn_correction_range_round_to_int",
}


def _add_mla_mtp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="mla")
    group.add_argument("--multi-latent-attention", action="store_true",
                       help="Multi-latent attention (DeepSeek-V2/V3): queries, keys and values from low-rank latents.")
    group.add_argument("--q-lora-rank", type=int, default=None,
                       help="Rank of the query compression (unset: queries are projected directly).")
    group.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the key/value compression.")
    group.add_argument("--qk-head-dim", type=int, default=128,
                       help="Per-head query/key width without position (q head = qk-head-dim + qk-pos-emb-head-dim).")
    group.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="Per-head width of the rotated part.")
    group.add_argument("--v-head-dim", type=int, default=128, help="Per-head value width.")
    group.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                       help="RoPE of multi-latent attention (default yarn); standard attention takes rope only.")
    group.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN scaling factor.")
    group.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale of multi-latent attention.")
    group.add_argument("--mscale-all-dim", type=float, default=0.0,
                       help="YaRN mscale_all_dim of multi-latent attention (also scales the softmax).")
    group.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                       help="YaRN: context length of the original model (default 4096).")
    group.add_argument("--yarn-beta-fast", type=float, default=None, help="YaRN beta_fast (default 32).")
    group.add_argument("--yarn-beta-slow", type=float, default=None, help="YaRN beta_slow (default 1).")
    group.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                       help="Round the YaRN correction range to integers (the default).")
    group.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                       dest="yarn_correction_range_round_to_int", help="Do not round the YaRN correction range.")
    group.add_argument("--cache-mla-latents", action="store_true",
                       help="Cache the latents in generation (not supported yet).")
    group.add_argument("--mla-down-proj-fusion", action="store_true",
                       help="Accepted for compatibility: the down projections compute the same function either way.")
    group = parser.add_argument_group(title="multi-token prediction")
    group.add_argument("--mtp-num-layers", type=int, default=None,
                       help="Multi-token prediction depth (extra layers predicting 2, 3, ... tokens ahead).")
    group.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                       help="Weight of the mean multi-token-prediction loss.")
    group = parser.add_argument_group(title="moe routing")
    group.add_argument("--moe-router-num-groups", type=int, default=None,
                       help="Group-limited routing: number of equal expert groups.")
    group.add_argument("--moe-router-group-topk", type=int, default=None,
                       help="Group-limited routing: groups each token may use.")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="Multiplies the routing weights of the chosen experts.")
    group.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                       help="Router precision (this router always computes in fp32; fp64 is not supported yet).")
    return parser


def mla_config_fields(args: argparse.Namespace) -> dict:
    """MLATransformerConfig fields named differently from their flags (module docstring); flags left unset
    keep the config's defaults."""
    fields = {field: getattr(args, dest) for field, dest in _YARN_FIELDS.items() if getattr(args, dest) is not None}
    fields["rope_type"] = args.rope_type or "yarn"  # unset: MLATransformerConfig's default, as in Megatron-LM
    return fields


def check_mla_mtp(args: argparse.Namespace, problems: list) -> None:
    """The couplings of these flags with the rest of the command line."""
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":
            problems.append("--rope-type yarn needs --multi-latent-attention (standard attention takes "
                            "--position-embedding-type rope)")
    elif args.group_query_attention:
        problems.append("--group-query-attention cannot be combined with --multi-latent-attention (every head has "
                        "its own keys and values, made from the shared latent)")
    if args.cache_mla_latents:
        problems.append("--cache-mla-latents: caching the latents in generation is not supported yet")
    if args.moe_router_dtype == "fp64":
        problems.append("--moe-router-dtype fp64 is not supported yet; the router computes in fp32 (--moe-router-dtype "
                        "fp32)")
    mtp = args.mtp_num_layers
    if mtp is not None and mtp < 1:
        problems.append(f"--mtp-num-layers {mtp} must be a positive integer")
    if mtp and args.context_parallel_size > 1:
        problems.append(f"--mtp-num-layers with --context-parallel-size {args.context_parallel_size} is not "
                        "supported yet")
    if mtp and args.pipeline_model_parallel_size > 1 and args.position_embedding_type == "learned_absolute":
        problems.append("--mtp-num-layers under pipeline parallelism needs --position-embedding-type rope or none "
                        "(the last stage's copy of learned position embeddings is not supported yet)")
