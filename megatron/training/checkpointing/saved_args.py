"""The training arguments a checkpoint records (Megatron's pickled argparse Namespace), as this version
reads them: under today's name of each renamed argument, with classes this installation lacks reported once,
and, for the tools that rebuild a model from a checkpoint alone, with today's default for every argument
the checkpoint did not record.
"""

import argparse
import copy

from megatron.core.dist_checkpointing.unpickling import unreadable_arguments
from megatron.training.arguments import build_parser
from megatron.training.console import print_rank_0

# The files whose unreadable arguments were reported (once per process).
_reported_unreadable: list = []
# Dests Megatron-LM renamed, {the name older checkpoints hold: the name now}.
_RENAMED_ARGUMENTS = {"norm_epsilon": "layernorm_epsilon", "apply_layernorm_1p": "layernorm_zero_centered_gamma"}


def add_current_argument_names(state_dict) -> None:
    """Gives the saved arguments of an older checkpoint (an older Megatron-LM's, or this project's before
    the rename) today's name of each renamed argument, so that readers use one name."""
    args = state_dict.get("args") if isinstance(state_dict, dict) else None
    if args is None:
        return
    for old, new in _RENAMED_ARGUMENTS.items():
        if hasattr(args, old) and not hasattr(args, new):
            setattr(args, new, getattr(args, old))


def report_unreadable_arguments(state_dict, source) -> None:
    """Says once per process which of the checkpoint's saved arguments hold classes this installation does
    not have (Megatron-LM's own enums and configs: read as placeholders, see unpickling.py)."""
    args = state_dict.get("args") if isinstance(state_dict, dict) else None
    unreadable = unreadable_arguments(args) if args is not None else {}
    if not unreadable or _reported_unreadable:
        return
    _reported_unreadable.append(source)
    listed = ", ".join(f"{name} = {value}" for name, value in unreadable.items())
    print_rank_0(
        f"note: {len(unreadable)} argument(s) saved in {source} hold classes this installation does not have "
        f"(written by another version of Megatron-LM); they were read as placeholders and are not used: {listed}"
    )


def with_current_defaults(checkpoint_args: argparse.Namespace) -> argparse.Namespace:
    """A copy of a checkpoint's saved arguments with this version's default for every argument it did not
    record (checkpoints of other Megatron-LM versions, or of older versions of this one, record another set)."""
    completed = copy.copy(checkpoint_args)
    for name, default in vars(build_parser().parse_args([])).items():
        if not hasattr(completed, name):
            setattr(completed, name, default)
    return completed
