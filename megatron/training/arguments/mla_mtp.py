"""How the multi-latent attention and multi-token prediction flags (megatron/training/config/mla.py) reach
`MLATransformerConfig`, and their rules across sections."""

import argparse

_YARN_FIELDS = {  # MLATransformerConfig field <- flag dest
    "original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
    "correction_range_round_to_int": "yarn_correction_range_round_to_int",
}


def mla_config_fields(args: argparse.Namespace) -> dict:
    """MLATransformerConfig fields named differently from their flags (module docstring); flags left unset
    keep the config's defaults."""
    fields = {field: getattr(args, dest) for field, dest in _YARN_FIELDS.items() if getattr(args, dest) is not None}
    fields["rope_type"] = args.rope_type or "yarn"  # unset: MLATransformerConfig's default, as in Megatron-LM
    return fields


def check_mla_mtp(args: argparse.Namespace, problems: list) -> None:
    """The couplings of these flags with the rest of the command line."""
    if args.multi_latent_attention and args.group_query_attention:
        problems.append("--group-query-attention cannot be combined with --multi-latent-attention (every head has "
                        "its own keys and values, made from the shared latent)")
    if args.multi_latent_attention and args.attention_output_gate:
        problems.append("--attention-output-gate with --multi-latent-attention is not supported yet")
    mtp = args.mtp_num_layers
    if mtp and args.context_parallel_size > 1:
        problems.append(f"--mtp-num-layers with --context-parallel-size {args.context_parallel_size} is not "
                        "supported yet")
    if mtp and args.pipeline_model_parallel_size > 1 and args.position_embedding_type == "learned_absolute":
        problems.append("--mtp-num-layers under pipeline parallelism needs --position-embedding-type rope or none "
                        "(the last stage's copy of learned position embeddings is not supported yet)")
