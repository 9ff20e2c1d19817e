"""`validate_args`: Megatron's derived values, then every problem of the command line in one error.

    1. deprecated flags translated (deprecated.py), an entry script's defaults applied
    2. each configuration section checks its own flags (`validate()` of megatron/training/config/*)
    3. the derived values are computed once (derived.py)
    4. the rules across sections run on the arguments with those values (CROSS_SECTION_CHECKS), then the
       table of features not built yet (unsupported.py); a line for each flag given that has no effect
       here (without_effect.py)
    5. with no problem, the derived values (and Megatron's run counters) are written into the namespace, once

Checks never stop at the first problem: each appends a message (with the numbers and the formula) to one
list, and a single ValueError lists them all, so one launch shows everything to fix.
"""

import argparse

from megatron.core.optimizer.optimizer_config import precision_aware_problems
from megatron.training.arguments.deprecated import translate_deprecated_args
from megatron.training.arguments.derived import derive_values
from megatron.training.arguments.reporting import is_rank_zero, print_rank_0
from megatron.training.arguments.unsupported import find_unsupported
from megatron.training.arguments.validate_cuda_graph import check_cuda_graph
from megatron.training.arguments.validate_fp8 import check_fp8
from megatron.training.arguments.mla_mtp import check_mla_mtp
from megatron.training.arguments.validate_fsdp import check_fsdp, check_megatron_fsdp_dtypes
from megatron.training.arguments.validate_model import check_model_shape
from megatron.training.arguments.validate_moe import check_moe
from megatron.training.arguments.validate_optimizer import check_muon
from megatron.training.arguments.validate_overlap import check_overlap_options
from megatron.training.arguments.validate_parallel import check_parallel_layout
from megatron.training.arguments.validate_schedule import check_batch_sizes, check_run_length
from megatron.training.arguments.without_effect import print_without_effect_notes
from megatron.training.config.run_config import RunConfig
from megatron.training.determinism import check_determinism


def _check_precision_aware_optimizer(args, problems: list) -> None:
    problems.extend(precision_aware_problems(args))


def _check_auto_resume(args, problems: list) -> None:
    if not args.auto_resume:
        return
    if args.save is None:
        problems.append("--auto-resume resumes from --save: give --save DIR")
    elif args.load != args.save:
        problems.append(f"--auto-resume resumes from --save {args.save}, but --load {args.load} names another "
                        "directory: drop one of --auto-resume and --load")


# Every rule that involves flags of several sections; each takes the arguments with the derived values.
CROSS_SECTION_CHECKS = (
    check_parallel_layout,
    check_model_shape,
    check_moe,
    check_mla_mtp,
    check_fsdp,
    check_megatron_fsdp_dtypes,
    check_batch_sizes,
    check_run_length,
    _check_precision_aware_optimizer,
    check_fp8,
    check_cuda_graph,
    _check_auto_resume,
    check_determinism,
    check_overlap_options,
    check_muon,
)


def _apply_script_defaults(args, defaults: dict) -> None:
    """An entry script's `args_defaults` fill flags left unset (None); a flag given by the user wins."""
    for key, value in defaults.items():
        if getattr(args, key, None) is not None:
            print_rank_0(f"WARNING: overriding default arguments for {key}:{value} with {key}:{getattr(args, key)}")
        else:
            setattr(args, key, value)


# Megatron's run counters, which code reading `args` expects from the start.
_COUNTERS = {"consumed_train_samples": 0, "skipped_train_samples": 0, "consumed_valid_samples": 0,
             "variable_seq_lengths": False}


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
    config = RunConfig.from_namespace(args)
    for section in config.sections():
        problems.extend(section.validate())
    derived = derive_values(config, args.world_size, problems)
    view = argparse.Namespace(**{**vars(args), **derived})
    for check in CROSS_SECTION_CHECKS:
        check(view, problems)
    problems.extend(find_unsupported(view))
    if problems:
        raise ValueError(f"{len(problems)} problem(s) with the arguments:\n  - " + "\n  - ".join(problems))
    print_without_effect_notes(view)
    vars(args).update(derived, **_COUNTERS)
    # Megatron drops the shorthand once translated into --recompute-granularity.
    vars(args).pop("recompute_activations", None)
    _print_args("arguments", args)
    return args
