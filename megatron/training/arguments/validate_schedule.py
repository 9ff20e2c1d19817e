"""Rules between the batch, the run length, the learning-rate schedule and the parallel layout (each
section's own rules are its `validate`: megatron/training/config/training.py, optimizer.py). The batch sizes'
rules are the batch plan's (megatron/training/batch_plan.py), where their arithmetic is. A step batch-size
schedule must be well formed here; each step's batch is checked when the run reaches it (an early step may
predate the layout of a resumed run, as in Megatron-LM).
"""

import argparse

from megatron.core.num_microbatches_calculator import parse_step_batch_size_schedule
from megatron.training.arguments.validate_parallel import describe_data_parallel_size
from megatron.training.batch_plan import BatchPlan


def check_batch_sizes(args: argparse.Namespace, problems: list) -> None:
    """micro batch x DP divides the global batch, the evaluation batch and every step of the ramp-up
    (`BatchPlan.size_problems`)."""
    mbs, dp, gbs = args.micro_batch_size, args.data_parallel_size, args.global_batch_size
    if mbs is None or mbs < 1 or dp is None or gbs is None or gbs < 1:
        return  # reported by the training flags or the parallel layout
    if args.step_batch_size_schedule is not None:
        try:
            parse_step_batch_size_schedule(args.step_batch_size_schedule, args.seq_length)
        except ValueError as error:
            problems.append(str(error))
            return  # the batch plan reads the schedule
    problems.extend(BatchPlan.from_args(args).size_problems(describe_data_parallel_size(args)))


def _check_schedule_unit(args, problems, unit: str, other: str) -> None:
    """With --train-<unit>, the schedule flags counted in <other> are refused (Megatron asserts the same)."""
    for name, unset in (("lr_decay", None), ("lr_warmup", 0), ("lr_wsd_decay", None)):
        if getattr(args, f"{name}_{other}") != unset:
            flag = f"--{name.replace('_', '-')}"
            problems.append(f"{flag}-{other} does not go with --train-{unit}; use {flag}-{unit}")
    if args.lr_warmup_fraction is not None and getattr(args, f"lr_warmup_{unit}") != 0:
        problems.append(f"give --lr-warmup-fraction or --lr-warmup-{unit}, not both")


def check_run_length(args: argparse.Namespace, problems: list) -> None:
    """A length unless only evaluating, a learning rate unless only evaluating, and schedule flags in the
    unit of the length."""
    iters, samples = args.train_iters, args.train_samples
    if iters is None and samples is None and not args.skip_train:
        problems.append("give --train-iters or --train-samples (or --skip-train)")
    if iters is not None:
        _check_schedule_unit(args, problems, "iters", "samples")
    if samples is not None:
        _check_schedule_unit(args, problems, "samples", "iters")
    if args.lr is None and not args.skip_train:
        problems.append("--lr is required for training")
