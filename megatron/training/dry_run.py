"""`--dry-run` (and `tools/estimate.py`): check a command line for a given world size without GPUs,
NCCL or data, and print what the run would need.

    WORLD_SIZE=64 python pretrain_gpt.py <flags> --dry-run

The arguments are validated as the real run validates them (every problem at once) and go through the
same checks before the model is built (preflight.py: data, tokenizer files, schedule, --save, --load), the
tokenizer is built from its files (for the padded vocabulary), then: the layout, parameters in total and
per GPU, tokens and FLOPs per iteration, and memory per GPU with and without full recomputation
(memory_estimate.py has the model). A run whose estimate does not fit the largest GPU there is, even with
full recomputation, is an error (exit status 1).
"""

from megatron.training.batch_plan import BatchPlan
from megatron.training.memory_estimate import GIB, estimate_memory, parameters_per_rank, total_parameters
from megatron.training.training_log import num_floating_point_operations


# The most memory one GPU has (B200 and MI300X: 192 GB); a run whose estimate exceeds it fits no GPU.
LARGEST_GPU = "NVIDIA B200, AMD MI300X"
LARGEST_GPU_BYTES = 192 * 10**9


def _in_unit(value: int, unit: int) -> str:
    return f"{value / unit:10.2f}"


def dry_run_report(args) -> str:
    """The dry run's text for validated `args` (with `padded_vocab_size` set)."""
    microbatches = BatchPlan.from_args(args).num_microbatches
    per_rank = parameters_per_rank(args)
    total = total_parameters(args)
    estimate = estimate_memory(args, microbatches)
    flops = num_floating_point_operations(args, args.global_batch_size)
    lines = [
        f"dry run: the arguments are valid for world size {args.world_size}",
        f"  layout: TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x "
        f"CP {args.context_parallel_size} x DP {args.data_parallel_size} (EP {args.expert_model_parallel_size})",
        f"  parameters: {total:,} in total ({total / 1e9:.3f} B); per GPU {per_rank['first stage']:,} on the first "
        f"pipeline stage, {per_rank['last stage']:,} on the last",
        f"  batch: global {args.global_batch_size} = micro {args.micro_batch_size} x {microbatches} microbatches x "
        f"DP {args.data_parallel_size}; {args.global_batch_size * args.seq_length:,} tokens per iteration",
        f"  FLOPs per iteration: {flops:.4e} (Megatron's dense formula, causal attention); "
        f"{flops / args.world_size:.4e} per GPU",
    ]
    unit, unit_name = (GIB, "GiB") if estimate.total >= GIB else (1024**2, "MiB")
    lines.append(f"  memory per GPU, first pipeline stage ({unit_name}):   no recompute   full recompute")
    for name, plain, recomputed in (
        ("weights", estimate.weights, estimate.weights),
        ("gradients", estimate.gradients, estimate.gradients),
        ("optimizer", estimate.optimizer, estimate.optimizer),
        ("activations", estimate.activations, estimate.activations_full_recompute),
        ("total", estimate.total, estimate.total_full_recompute),
    ):
        lines.append(f"    {name:<40}{_in_unit(plain, unit)}     {_in_unit(recomputed, unit)}")
    return "\n".join(lines)


def dry_run(args) -> None:
    """Builds the tokenizer (for the padded vocabulary), prints the report, and raises ValueError when the
    memory estimate fits no GPU."""
    from megatron.core.tokenizers import build_tokenizer

    if getattr(args, "padded_vocab_size", None) is None:
        build_tokenizer(args)
    print(dry_run_report(args), flush=True)
    estimate = estimate_memory(args, BatchPlan.from_args(args).num_microbatches)
    smallest = min(estimate.total, estimate.total_full_recompute)
    if smallest > LARGEST_GPU_BYTES:
        raise ValueError(
            f"the estimate needs {smallest / GIB:,.1f} GiB per GPU even with full recomputation, more than the "
            f"{LARGEST_GPU_BYTES / 1e9:.0f} GB of the largest GPU assumed ({LARGEST_GPU}): split the model further "
            "(--tensor-model-parallel-size, --pipeline-model-parallel-size), shard the optimizer "
            "(--use-distributed-optimizer), or use a smaller --micro-batch-size"
        )
