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
from megatron.core.dist_checkpointing.unpickling import holds_placeholders, tolerant_pickle_module
from megatron.training.checkpointing.saved_args import add_current_argument_names, report_unreadable_arguments

# The `checkpoint_version` every torch-format file records (Megatron-LM writes 3.0).
CHECKPOINT_VERSION = 3.0


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
