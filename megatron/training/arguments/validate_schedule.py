"""Rules between the batch, the run length, the learning-rate schedule and the parallel layout (each
section's own rules are its `validate`: megatron/training/config/training.py, optimizer.py).

    global batch = micro batch x microbatches x data-parallel size
    ramp-up: global batch goes start, start + incr, ... up to --global-batch-size, so every step of it
             must also be a multiple of micro batch x DP
    step schedule: well formed; each step's batch is checked when the run reaches it (an early step may
             predate the layout of a resumed run, as in Megatron-LM)
"""

import argparse

from megatron.core.num_microbatches_calculator import parse_step_batch_size_schedule
from megatron.training.arguments.validate_parallel import describe_data_parallel_size


def _nearest_multiples(value: int, step: int) -> str:
    below = value // step * step
    return f"{below} or {below + step}" if below > 0 else str(step)


def check_batch_sizes(args: argparse.Namespace, problems: list) -> None:
    """micro batch x DP divides the global batch, the evaluation batch and every step of the ramp-up."""
    mbs, dp, gbs = args.micro_batch_size, args.data_parallel_size, args.global_batch_size
    if mbs is None or mbs < 1 or dp is None or gbs is None or gbs < 1:
        return  # reported by the training flags or the parallel layout
    per_microbatch = mbs * dp
    if gbs % per_microbatch and not args.decrease_batch_size_if_needed:
        problems.append(f"global batch size {gbs} is not a multiple of micro batch size {mbs} x "
                        f"{describe_data_parallel_size(args)}; nearest valid: "
                        f"{_nearest_multiples(gbs, per_microbatch)}")
    eval_mbs, eval_gbs = args.eval_micro_batch_size, args.eval_global_batch_size
    if None not in (eval_mbs, eval_gbs) and min(eval_mbs, eval_gbs) >= 1 and eval_gbs % (eval_mbs * dp):
        problems.append(f"--eval-global-batch-size {eval_gbs} is not a multiple of --eval-micro-batch-size {eval_mbs} x "
                        f"{describe_data_parallel_size(args)}; nearest valid: "
                        f"{_nearest_multiples(eval_gbs, eval_mbs * dp)}")
    if args.step_batch_size_schedule is not None:
        try:
            parse_step_batch_size_schedule(args.step_batch_size_schedule, args.seq_length)
        except ValueError as error:
            problems.append(str(error))
    if args.rampup_batch_size is None or len(args.rampup_batch_size) != 3 or min(args.rampup_batch_size) < 1:
        return
    start, increment, _ = args.rampup_batch_size
    if start > gbs or (gbs - start) % increment:
        problems.append(f"--rampup-batch-size: --global-batch-size {gbs} - start {start} = {gbs - start} must be "
                        f"a non-negative multiple of the increment {increment}")
    if not args.decrease_batch_size_if_needed:
        # Step 0 is `start`, step 1 is `start + increment`: both multiples iff each one is.
        steps = (("start", start), ("increment", increment)) if start < gbs else (("start", start),)
        for name, value in steps:
            if value % per_microbatch:
                problems.append(f"--rampup-batch-size {name} {value} is not a multiple of micro batch size "
                                f"{mbs} x {describe_data_parallel_size(args)}")


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
