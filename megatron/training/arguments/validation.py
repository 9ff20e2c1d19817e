"""`validate_args`: Megatron's derived values, then every problem of the command line in one error.

Checks never stop at the first problem: each appends a message (with the numbers and the formula) to one
list, and a single ValueError lists them all, so one launch shows everything to fix.
"""

import argparse
import re

import torch

from megatron.core.optimizer.optimizer_config import DTYPE_OF_NAME, precision_aware_problems
from megatron.training.arguments.deprecated import translate_deprecated_args
from megatron.training.arguments.reporting import is_rank_zero, print_rank_0, warn_rank_0
from megatron.training.arguments.validate_cuda_graph import check_cuda_graph
from megatron.training.arguments.resilience import check_resilience
from megatron.training.arguments.unsupported import find_unsupported
from megatron.training.arguments.validate_fp8 import check_fp8
from megatron.training.arguments.mla_mtp import check_mla_mtp
from megatron.training.arguments.validate_model import check_recompute, derive_model_shape
from megatron.training.arguments.validate_moe import check_moe
from megatron.training.arguments.validate_parallel import derive_parallel_sizes
from megatron.training.arguments.validate_pipeline import derive_pipeline_stages
from megatron.training.arguments.validate_schedule import check_learning_rate, check_run_length, derive_batch_sizes

# Megatron's split when --data-path comes without --split.
LEGACY_DEFAULT_SPLIT = "969, 30, 1"


def _apply_script_defaults(args, defaults: dict) -> None:
    """An entry script's `args_defaults` fill flags left unset (None); a flag given by the user wins."""
    for key, value in defaults.items():
        if getattr(args, key, None) is not None:
            print_rank_0(f"WARNING: overriding default arguments for {key}:{value} with {key}:{getattr(args, key)}")
        else:
            setattr(args, key, value)


def _derive_precision(args, problems) -> None:
    args.params_dtype = torch.float32
    if args.fp16 and args.bf16:
        problems.append("--fp16 and --bf16 are mutually exclusive")
    elif args.fp16:
        args.params_dtype = torch.float16
        if not args.loss_scale:
            # With dynamic loss scaling an inf/nan gradient is the scaler's signal, not an error.
            args.check_for_nan_in_loss_and_grad = False
            print_rank_0("WARNING: Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss "
                         "scaling is being used")
    elif args.bf16:
        args.params_dtype = torch.bfloat16
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
        elif not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            print_rank_0("accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    if args.grad_reduce_in_bf16 and not args.bf16:
        problems.append("--grad-reduce-in-bf16 needs --bf16")
    if args.fp16_lm_cross_entropy and not args.fp16:
        problems.append("--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        problems.append("--fp32-residual-connection needs --fp16 or --bf16")
    if args.loss_scale is not None and args.loss_scale <= 0:
        problems.append(f"--loss-scale {args.loss_scale} must be positive")
    print_rank_0(f"using {args.params_dtype} for parameters ...")


def _derive_optimizer_dtypes(args, problems) -> None:
    """--main-grads-dtype, --main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype become torch dtypes (as
    Megatron-LM's validate_args makes them), checked with the precision-aware optimizer's rules."""
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, name)
        setattr(args, name, value if isinstance(value, torch.dtype) else DTYPE_OF_NAME[value])
    problems.extend(precision_aware_problems(args))


def _check_split(split: str, problems) -> None:
    """Megatron reads up to three non-negative numbers ("949,50,1", "98/2"); missing ones are 0."""
    parts = [part for part in re.split(r"[,/]", split) if part.strip()]
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        problems.append(f"--split {split!r} must be up to three comma-separated numbers, e.g. 949,50,1")
        return
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        problems.append(f"--split {split!r} must be 1 to 3 non-negative numbers with a positive sum, e.g. 949,50,1")


def _check_data(args, problems) -> None:
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    if args.data_path is not None and args.split is None:
        warn_rank_0(f'Please specify --split when using --data-path. Using legacy default value of '
                    f'"{LEGACY_DEFAULT_SPLIT}"')
        args.split = LEGACY_DEFAULT_SPLIT
    if args.split is not None:
        _check_split(args.split, problems)
    per_split = [flag for flag, value in (("--train-data-path", args.train_data_path),
                                          ("--valid-data-path", args.valid_data_path),
                                          ("--test-data-path", args.test_data_path)) if value is not None]
    if args.data_path is not None and args.data_args_path is not None:
        problems.append("give --data-path or --data-args-path, not both")
    if per_split and args.per_split_data_args_path is not None:
        problems.append(f"give {', '.join(per_split)} or --per-split-data-args-path, not both")
    sources = [name for name, used in (
        ("--mock-data", args.mock_data),
        ("--data-path", args.data_path is not None or args.data_args_path is not None),
        ("per-split paths", bool(per_split) or args.per_split_data_args_path is not None),
    ) if used]
    if len(sources) > 1:
        problems.append(f"choose one data source: {' and '.join(sources)} were both given")
    if args.num_dataset_builder_threads < 1:
        problems.append(f"--num-dataset-builder-threads {args.num_dataset_builder_threads} must be positive")
    if args.num_workers < 0:
        problems.append(f"--num-workers {args.num_workers} must be >= 0")
    for flag, probability in (("--mask-prob", args.mask_prob), ("--short-seq-prob", args.short_seq_prob)):
        if not 0.0 <= probability <= 1.0:
            problems.append(f"{flag} {probability} must be in [0, 1]")


def _check_checkpointing(args, problems) -> None:
    if args.save is not None and args.save_interval is None:
        problems.append("--save needs --save-interval")
    if args.save_retain_interval is not None:
        if args.save_interval is None or args.save_retain_interval % args.save_interval:
            problems.append(f"--save-retain-interval {args.save_retain_interval} must be a multiple of "
                            f"--save-interval {args.save_interval}")
    if args.async_save and args.ckpt_format != "torch_dist":
        problems.append(f"--async-save needs --ckpt-format torch_dist (this run has --ckpt-format {args.ckpt_format})")
    if args.ckpt_convert_format is not None:
        missing = [flag for flag, value in (("--ckpt-convert-save", args.ckpt_convert_save), ("--load", args.load))
                   if value is None]
        if missing:
            problems.append(f"--ckpt-convert-format {args.ckpt_convert_format} needs {' and '.join(missing)}: the "
                            "checkpoint under --load is saved again under <--ckpt-convert-save>/<format>")
        args.exit_on_missing_checkpoint = True


def _check_profiling(args, problems) -> None:
    if args.profile and args.profile_step_end <= args.profile_step_start:
        problems.append(f"--profile-step-end {args.profile_step_end} must be above --profile-step-start "
                        f"{args.profile_step_start} (iterations start to end - 1 are profiled)")
    if args.manual_gc_interval < 0:
        problems.append(f"--manual-gc-interval {args.manual_gc_interval} must be >= 0")


def _start_counters(args) -> None:
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    args.variable_seq_lengths = False


def _print_args(title: str, args) -> None:
    """Megatron's sorted, dot-aligned dump of every argument (rank 0)."""
    if not is_rank_zero():
        return
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    print(f"------------------------ {title} ------------------------", flush=True)
    print("\n".join(sorted(lines, key=str.lower)), flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)


def validate_args(args: argparse.Namespace, defaults: dict = {}) -> argparse.Namespace:  # noqa: B006
    """Translates deprecated flags, applies `defaults` (an entry script's `args_defaults`; the mutable
    default is Megatron's signature, never mutated), derives Megatron's values, and raises one ValueError
    listing every problem found. Returns `args`."""
    problems = []
    translate_deprecated_args(args, problems)
    _apply_script_defaults(args, defaults)
    derive_parallel_sizes(args, problems)
    derive_model_shape(args, problems)
    derive_pipeline_stages(args, problems)
    check_recompute(args, problems)
    check_moe(args, problems)
    check_mla_mtp(args, problems)
    derive_batch_sizes(args, problems)
    check_run_length(args, problems)
    check_learning_rate(args, problems)
    _derive_precision(args, problems)
    _derive_optimizer_dtypes(args, problems)
    check_fp8(args, problems)
    check_cuda_graph(args, problems)
    _check_data(args, problems)
    _check_checkpointing(args, problems)
    check_resilience(args, problems)
    _check_profiling(args, problems)
    _start_counters(args)
    problems.extend(find_unsupported(args))
    if problems:
        raise ValueError(f"{len(problems)} problem(s) with the arguments:\n  - " + "\n  - ".join(problems))
    _print_args("arguments", args)
    return args
