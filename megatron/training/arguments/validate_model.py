"""Rules between the model's shape and the other sections (the shape's own rules are
`NetworkSizeConfig.validate`, megatron/training/config/model.py).

The split of a layer over tensor-parallel ranks, the recomputed layer counts and the linear-attention layers
are Megatron-Core's rules
(megatron/core/transformer/config_rules.py), run here before any `TransformerConfig` exists, with messages
that name the flags.
"""

import argparse

from megatron.core.transformer.activation_offload import offload_module_problems
from megatron.core.transformer.config_rules import (
    linear_attention_problems,
    recompute_layer_problems,
    recompute_module_problems,
    tensor_parallel_split_problems,
)
from megatron.core.transformer.mup import mup_problems
from megatron.training.config.run_config import RunConfig


def flag_setting(dest: str, *value) -> str:
    """A setting named as on the command line: `--num-layers`, or with its value `--num-layers 6`."""
    flag = RunConfig.flag_names()[dest]
    return f"{flag} {value[0]}" if value else flag


def _check_tensor_parallel_split(args, problems: list) -> None:
    if None in (args.num_attention_heads, args.ffn_hidden_size) or args.num_attention_heads < 1:
        return  # the sizes are reported as missing
    # --num-query-groups only counts with --group-query-attention (None: one group per head).
    groups = args.num_query_groups if args.group_query_attention else None
    problems.extend(tensor_parallel_split_problems(args.num_attention_heads, groups, args.ffn_hidden_size,
                                                   args.tensor_model_parallel_size, name=flag_setting))


def _check_sequence_lengths(args, problems: list) -> None:
    """Each CP rank holds two chunks of the sequence; with sequence parallelism each is split again over TP."""
    if args.seq_length is None:
        return  # reported by the data flags
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1 and args.seq_length % (2 * cp):
        problems.append(f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size {cp} "
                        f"= {2 * cp} (each CP rank holds two chunks)")
    sequence_multiple = tp * 2 * cp if cp > 1 else tp
    if args.sequence_parallel and tp >= 1 and args.seq_length % sequence_multiple:
        shown = f"--tensor-model-parallel-size {tp}" + (
            f" x 2 x --context-parallel-size {cp} = {sequence_multiple}" if cp > 1 else "")
        problems.append(f"--seq-length {args.seq_length} must be divisible by {shown} with --sequence-parallel")
    max_positions = args.max_position_embeddings
    if max_positions is not None:
        for flag, length in (("--seq-length", args.seq_length), ("--decoder-seq-length", args.decoder_seq_length)):
            if length is not None and max_positions < length:
                problems.append(f"--max-position-embeddings {max_positions} must be >= {flag} {length}")


def check_model_shape(args: argparse.Namespace, problems: list) -> None:
    """The shape against the parallel layout and the sequence length; the recompute layer counts and modules;
    the offloaded modules (with the recompute ones); the linear attention layers against the layers and the
    layout; the muP sizes."""
    _check_tensor_parallel_split(args, problems)
    problems.extend(linear_attention_problems(args, name=flag_setting))
    _check_sequence_lengths(args, problems)
    problems.extend(recompute_layer_problems(args.recompute_granularity, args.recompute_method,
                                             args.recompute_num_layers, args.num_layers or None,
                                             args.pipeline_model_parallel_size, name=flag_setting))
    problems.extend(recompute_module_problems(args.recompute_granularity, args.recompute_modules, args,
                                              name=flag_setting))
    problems.extend(offload_module_problems(args, name=flag_setting))
    if args.fine_grained_activation_offloading and args.cuda_graph_impl != "none":
        problems.append(f"--fine-grained-activation-offloading with --cuda-graph-impl {args.cuda_graph_impl} is not "
                        "supported yet")
    problems.extend(mup_problems(args, name=flag_setting))
    if args.distribute_saved_activations and args.sequence_parallel:
        problems.append("--distribute-saved-activations cannot be combined with --sequence-parallel")
