"""Parallel layout: data-parallel size and the flags that depend on it.

    world size = TP x PP x CP x DP        (dense ranks; DP is derived, never given)

The layer split over pipeline stages is checked in validate_pipeline.py.
"""

import argparse
import math
import os
import sys

from megatron.core.model_parallel_config import divisors
from megatron.core.transformer.context_parallel.context_parallel_attention import (
    CP_COMM_TYPES,
    CP_COMM_TYPES_NOT_YET,
    canonical_cp_comm_type,
)
from megatron.training.arguments.reporting import print_rank_0, warn_rank_0


def legal_sizes(n: int) -> str:
    """The divisors of n as text, "1, 2, 3, 4, 6, 12": the legal sizes when something must divide n."""
    return ", ".join(map(str, divisors(n)))


def _layout(args) -> str:
    return (f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} "
            f"x CP {args.context_parallel_size}")


def describe_data_parallel_size(args) -> str:
    """'data parallel size 2 (= world size 8 / (TP 4 x PP 1 x CP 1))', for messages."""
    return f"data parallel size {args.data_parallel_size} (= world size {args.world_size} / ({_layout(args)}))"


def _launcher_hint(model_size: int) -> str:
    """For a process started without torchrun (no WORLD_SIZE): how to start the ranks the layout needs."""
    if "WORLD_SIZE" in os.environ:
        return ""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "pretrain_gpt.py"
    return (f". This is one process started without torchrun: start {model_size} (or a multiple) with "
            f"torchrun --nproc-per-node {model_size} {script} ...")


def derive_parallel_sizes(args: argparse.Namespace, problems: list) -> None:
    """Sets data_parallel_size (None when the layout does not fit the world) and the dependent defaults."""
    sizes = {
        "--tensor-model-parallel-size": args.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--context-parallel-size": args.context_parallel_size,
        "--expert-model-parallel-size": args.expert_model_parallel_size,
    }
    for flag, size in sizes.items():
        if size < 1:
            problems.append(f"{flag} {size} must be at least 1")
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size

    model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = None
    if min(sizes.values()) >= 1:
        if args.world_size % model_size:
            problems.append(f"world size {args.world_size} is not divisible by {_layout(args)} = {model_size}; "
                            f"TP x PP x CP must be one of {legal_sizes(args.world_size)}{_launcher_hint(model_size)}")
        else:
            args.data_parallel_size = args.world_size // model_size
            print_rank_0(f"using world size: {args.world_size}, data-parallel size: {args.data_parallel_size}, "
                         f"context-parallel size: {args.context_parallel_size}, "
                         f"tensor-model-parallel size: {args.tensor_model_parallel_size}, "
                         f"pipeline-model-parallel size: {args.pipeline_model_parallel_size}")

    # Megatron turns sequence parallelism off at TP = 1 so that the numerics do not change.
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        warn_rank_0("disabling --sequence-parallel because --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    if args.tp_comm_overlap and not args.sequence_parallel:
        problems.append("--tp-comm-overlap needs --sequence-parallel (with --tensor-model-parallel-size > 1)")
    if args.tp_comm_overlap and args.fp8 is not None:
        problems.append(f"--tp-comm-overlap: not supported yet with --fp8-format {args.fp8} (the FP8 GEMMs keep their "
                        "sequence-parallel collectives apart); drop one of the two flags")
    if args.overlap_param_gather:
        if not (args.use_distributed_optimizer or args.use_megatron_fsdp):
            problems.append("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)")
        if not args.overlap_grad_reduce:
            problems.append("--overlap-param-gather needs --overlap-grad-reduce")
    if args.distribute_saved_activations and args.tensor_model_parallel_size == 1:
        problems.append("--distribute-saved-activations shards over the tensor-parallel group and needs "
                        "--tensor-model-parallel-size > 1")

    _check_context_parallel(args, problems)


def _check_context_parallel(args, problems: list) -> None:
    """--cp-comm-type and the features context-parallel attention does not combine with yet."""
    cp = args.context_parallel_size
    hierarchical = args.hierarchical_context_parallel_sizes
    if hierarchical and math.prod(hierarchical) != cp:
        problems.append(f"--hierarchical-context-parallel-sizes {hierarchical} multiply to "
                        f"{math.prod(hierarchical)}, not --context-parallel-size {cp}")
    if "a2a+p2p" in args.cp_comm_type and not hierarchical:
        problems.append("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
    if cp == 1:
        return
    num_layers = args.num_layers if args.num_layers is not None else args.encoder_num_layers
    if len(args.cp_comm_type) > 1 and num_layers is not None and len(args.cp_comm_type) != num_layers:
        problems.append(f"--cp-comm-type lists {len(args.cp_comm_type)} types; give one for all layers or one per "
                        f"layer ({num_layers})")
    for name in dict.fromkeys(args.cp_comm_type):
        if canonical_cp_comm_type(name) in CP_COMM_TYPES_NOT_YET:
            problems.append(f"--cp-comm-type {name} is not supported yet; use p2p (ring) or allgather")
        elif canonical_cp_comm_type(name) not in CP_COMM_TYPES:
            problems.append(f"--cp-comm-type {name} is not one of p2p, allgather, a2a, a2a+p2p")
    if args.reset_attention_mask:
        problems.append(f"--reset-attention-mask with --context-parallel-size {cp} is not supported yet "
                        f"(context-parallel attention takes no explicit mask)")
