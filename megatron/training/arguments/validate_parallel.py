"""Rules between the parallel layout and the other sections (the layout's own rules are
`DistributedConfig.validate`, megatron/training/config/parallel.py).

    world size = TP x PP x CP x DP        (dense ranks; DP is derived, never given)

The layer split over pipeline stages is checked in validate_pipeline.py.
"""

import argparse
import os
import sys

from megatron.core.model_parallel_config import legal_sizes


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


def world_size_problem(args) -> str:
    """The message for a world size that TP x PP x CP does not divide."""
    model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    return (f"world size {args.world_size} is not divisible by {_layout(args)} = {model_size}; TP x PP x CP must be "
            f"one of {legal_sizes(args.world_size)}{_launcher_hint(model_size)}")


def check_parallel_layout(args: argparse.Namespace, problems: list) -> None:
    """The parallel layout against the model, precision, recompute and data flags."""
    if args.tp_comm_overlap and args.fp8 is not None:
        problems.append(f"--tp-comm-overlap: not supported yet with --fp8-format {args.fp8} (the FP8 GEMMs keep their "
                        "sequence-parallel collectives apart); drop one of the two flags")
    if args.distribute_saved_activations and args.tensor_model_parallel_size == 1:
        problems.append("--distribute-saved-activations shards over the tensor-parallel group and needs "
                        "--tensor-model-parallel-size > 1")
    cp = args.context_parallel_size
    if cp <= 1:
        return
    if len(args.cp_comm_type) > 1 and args.num_layers is not None and len(args.cp_comm_type) != args.num_layers:
        problems.append(f"--cp-comm-type lists {len(args.cp_comm_type)} types; give one for all layers or one per "
                        f"layer ({args.num_layers})")
    if args.reset_attention_mask:
        problems.append(f"--reset-attention-mask with --context-parallel-size {cp} is not supported yet "
                        f"(context-parallel attention takes no explicit mask)")
