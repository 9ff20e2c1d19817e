"""Batch arithmetic, run length and the learning-rate schedule.

    global batch = micro batch x microbatches x data-parallel size
    ramp-up: global batch goes start, start + incr, ... up to --global-batch-size, so every step of it
             must also be a multiple of micro batch x DP
"""

import argparse
import signal

from megatron.training.arguments.reporting import print_rank_0
from megatron.training.arguments.validate_parallel import describe_data_parallel_size


def _nearest_multiples(value: int, step: int) -> str:
    below = value // step * step
    return f"{below} or {below + step}" if below > 0 else str(step)


def derive_batch_sizes(args: argparse.Namespace, problems: list) -> None:
    """Sets the default global batch and checks that micro batch x DP divides it."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if mbs is None:
        problems.append("--micro-batch-size is required")
        return
    if mbs < 1:
        problems.append(f"--micro-batch-size {mbs} must be positive")
        return
    if dp is None:
        return  # the parallel layout is already reported as wrong
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
        print_rank_0(f"setting global batch size to {args.global_batch_size} "
                     f"(= micro batch size {mbs} x {describe_data_parallel_size(args)})")
    gbs, per_microbatch = args.global_batch_size, mbs * dp
    if gbs < 1:
        problems.append(f"--global-batch-size {gbs} must be positive")
        return
    if gbs % per_microbatch == 0:
        print_rank_0(f"global batch size {gbs} = micro batch size {mbs} x {gbs // per_microbatch} microbatches "
                     f"x data parallel size {dp}")
    elif not args.decrease_batch_size_if_needed:
        problems.append(f"global batch size {gbs} is not a multiple of micro batch size {mbs} x "
                        f"{describe_data_parallel_size(args)}; nearest valid: "
                        f"{_nearest_multiples(gbs, per_microbatch)}")
    if args.rampup_batch_size is not None:
        _check_rampup(args, per_microbatch, problems)


def _check_rampup(args, per_microbatch: int, problems: list) -> None:
    if len(args.rampup_batch_size) != 3:
        problems.append(f"--rampup-batch-size takes 3 values <start> <increment> <samples>, got "
                        f"{args.rampup_batch_size}")
        return
    start, increment, samples = args.rampup_batch_size
    if min(start, increment, samples) < 1:
        problems.append(f"--rampup-batch-size {start} {increment} {samples}: all values must be positive")
        return
    gbs = args.global_batch_size
    if start > gbs or (gbs - start) % increment:
        problems.append(f"--rampup-batch-size: --global-batch-size {gbs} - start {start} = {gbs - start} must be "
                        f"a non-negative multiple of the increment {increment}")
    if not args.decrease_batch_size_if_needed:
        # Step 0 is `start`, step 1 is `start + increment`: both multiples iff each one is.
        steps = (("start", start), ("increment", increment)) if start < gbs else (("start", start),)
        for name, value in steps:
            if value % per_microbatch:
                problems.append(f"--rampup-batch-size {name} {value} is not a multiple of micro batch size "
                                f"{args.micro_batch_size} x {describe_data_parallel_size(args)}")


def _check_schedule_unit(args, problems, unit: str, other: str) -> None:
    """With --train-<unit>, the schedule flags counted in <other> are refused (Megatron asserts the same)."""
    for name, unset in (("lr_decay", None), ("lr_warmup", 0), ("lr_wsd_decay", None)):
        if getattr(args, f"{name}_{other}") != unset:
            flag = f"--{name.replace('_', '-')}"
            problems.append(f"{flag}-{other} does not go with --train-{unit}; use {flag}-{unit}")
    if args.lr_warmup_fraction is not None and getattr(args, f"lr_warmup_{unit}") != 0:
        problems.append(f"give --lr-warmup-fraction or --lr-warmup-{unit}, not both")


def check_run_length(args: argparse.Namespace, problems: list) -> None:
    """Exactly one of --train-iters / --train-samples, and schedule flags in the same unit."""
    iters, samples = args.train_iters, args.train_samples
    if iters is not None and samples is not None:
        problems.append(f"give --train-iters or --train-samples, not both (got {iters} and {samples})")
    elif iters is None and samples is None and not args.skip_train:
        problems.append("give --train-iters or --train-samples (or --skip-train)")
    if iters is not None:
        _check_schedule_unit(args, problems, "iters", "samples")
        if args.rampup_batch_size is not None:
            problems.append("--rampup-batch-size needs sample-based training: use --train-samples instead of "
                            "--train-iters")
    if samples is not None:
        _check_schedule_unit(args, problems, "samples", "iters")
    for flag, value in (("--train-iters", iters), ("--train-samples", samples), ("--log-interval", args.log_interval),
                        ("--eval-interval", args.eval_interval), ("--save-interval", args.save_interval)):
        if value is not None and value < 1:
            problems.append(f"{flag} {value} must be positive")
    if args.eval_iters < 0:
        problems.append(f"--eval-iters {args.eval_iters} must be >= 0")
    args.exit_signal = signal.Signals[args.exit_signal] if isinstance(args.exit_signal, str) else args.exit_signal


def check_learning_rate(args: argparse.Namespace, problems: list) -> None:
    """Learning rate, its warmup and decay, and the weight-decay ramp."""
    if args.lr is None:
        if not args.skip_train:
            problems.append("--lr is required for training")
    elif args.lr < 0:
        problems.append(f"--lr {args.lr} must be >= 0 (the optimizer steps against the gradient by --lr)")
    elif args.min_lr > args.lr:
        problems.append(f"--min-lr {args.min_lr} must be <= --lr {args.lr}")
    if args.min_lr < 0:
        problems.append(f"--min-lr {args.min_lr} must be >= 0")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        problems.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in [0, 1]")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        problems.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    if args.weight_decay_incr_style == "constant":
        if {args.start_weight_decay, args.end_weight_decay} - {None, args.weight_decay}:
            problems.append("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
                            "cosine; with constant use --weight-decay")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        problems.append(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                        f"--end-weight-decay")
