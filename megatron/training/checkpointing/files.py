"""Crash-safe checkpoint files: a file only ever appears under its final name complete.

Each write goes to a temporary file in the same directory, is flushed to disk, then renamed over the final
name (`os.replace` is atomic within one file system). A crash mid-write leaves at most a stray
`.<name>.*.tmp` file, never a truncated `model_optim_rng.pt` or tracker.
"""

import os
import pickle
import zipfile

import torch

from megatron.core.atomic_write import write_atomically
from megatron.core.dist_checkpointing.unpickling import (
    holds_placeholders,
    tolerant_pickle_module,
    unreadable_arguments,
)
from megatron.training.console import print_rank_0

# The `checkpoint_version` every torch-format file records (Megatron-LM writes 3.0).
CHECKPOINT_VERSION = 3.0
# The files whose unreadable arguments were reported (once per process).
_reported_unreadable: list = []
# Dests Megatron-LM renamed, {the name older checkpoints hold: the name now}.
_RENAMED_ARGUMENTS = {"norm_epsilon": "layernorm_epsilon", "apply_layernorm_1p": "layernorm_zero_centered_gamma"}


def save_atomically(obj, filename) -> None:
    """`torch.save(obj, filename)`, crash-safe; saved arguments read as placeholders (another Megatron-LM's)
    are written back as they were."""
    args = obj.get("args") if isinstance(obj, dict) else None
    if args is not None and holds_placeholders(args):
        write_atomically(filename, lambda file: torch.save(obj, file, pickle_module=tolerant_pickle_module))
    else:
        write_atomically(filename, lambda file: torch.save(obj, file))


def write_text_atomically(text: str, filename) -> None:
    """Writes `text` to `filename`, crash-safe."""
    write_atomically(filename, lambda file: file.write(text.encode()))


def load_checkpoint_file(filename):
    """`torch.load` of a checkpoint file onto the CPU, with an error naming the file when it is missing,
    truncated, or needs code that is not installed.

    Checkpoints hold the pickled argparse Namespace (Megatron's format), so they are unpickled in full
    (`weights_only=False`): load only checkpoints you trust. Classes this installation lacks (Megatron-LM's
    enums in its saved arguments) become placeholders, named once (unpickling.py).
    """
    if not os.path.isfile(filename):
        directory = os.path.dirname(os.path.dirname(filename))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint file {filename} does not exist (nor does {directory})")
        raise FileNotFoundError(
            f"checkpoint file {filename} does not exist; {directory} holds "
            f"{', '.join(sorted(os.listdir(directory))) or 'nothing'}. Other mp_rank_* directories mean the "
            "checkpoint was written with another tensor/pipeline/expert-parallel layout"
        )
    try:
        state_dict = torch.load(filename, map_location="cpu", weights_only=False, pickle_module=tolerant_pickle_module)
    except PermissionError:
        raise
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        # A cut-off zip archive surfaces as OSError (EINVAL) or RuntimeError, depending on where it ends.
        raise ValueError(
            f"checkpoint file {filename} ({os.path.getsize(filename)} bytes) is corrupt or truncated and cannot "
            f"be read ({error}); load an earlier iteration with --ckpt-step"
        ) from error
    except (ModuleNotFoundError, AttributeError) as error:
        raise ValueError(
            f"checkpoint file {filename} refers to code that is not available here ({error}); it was probably "
            "written by another version of Megatron-LM"
        ) from error
    add_current_argument_names(state_dict)
    report_unreadable_arguments(state_dict, filename)
    return state_dict


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
