"""What a failed or interrupted checkpoint save tells the user: which save, why, and that the previous
checkpoint is intact (files are renamed into place complete and the tracker is written last, files.py).

Without this, a full disk ends the run with torch's `[enforce fail at inline_container.cc:672] unexpected
pos 704 vs 598` (torch.save's zip writer fails on a short write) and Ctrl-C with a traceback through the
pickler. The messages name the iteration directory rather than a rank's file, so that the tensor-parallel
ranks that fail together say the same thing and the error is printed once (megatron/training/errors.py).
"""

import contextlib
import errno
import os
import shutil

from megatron.training.checkpointing.layout import get_checkpoint_tracker_filename

# What torch.save's C++ zip writer says when a write comes up short.
_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "unexpected pos", "file write failed")
# Less free space than this after a short write: the disk is full.
_NEARLY_FULL_BYTES = 64 * 2**20


def _previous_checkpoint(save_dir: str) -> str:
    tracker = get_checkpoint_tracker_filename(save_dir)
    try:
        with open(tracker) as stream:
            saved = stream.read().strip()
    except OSError:
        return f"no earlier checkpoint was complete in {save_dir}"
    return f"the previous checkpoint ({saved}, named by {tracker}) is intact"


def _free_bytes(directory: str) -> int | None:
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    try:
        return shutil.disk_usage(directory or ".").free
    except OSError:
        return None


def _write_failure(error: BaseException) -> BaseException | None:
    """The OSError, or torch's RuntimeError for a short write, behind `error`; None for anything else.

    torch.distributed.checkpoint reports the ranks' errors in one CheckpointException, whose `failures`
    maps each failed rank to (its exception, its traceback)."""
    if type(error).__name__ == "CheckpointException" and getattr(error, "failures", None):
        failure = next(iter(error.failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(error, OSError):
        return error
    if isinstance(error, RuntimeError) and any(text in str(error) for text in _WRITE_FAILURES):
        return error
    return None


@contextlib.contextmanager
def explain_save_failure(save_dir: str, iteration: int, checkpoint_dir: str):
    """Re-raises a failed write (OSError, or torch's RuntimeError for a short write) as an OSError, and
    Ctrl-C as a KeyboardInterrupt, whose message says which save failed and what is left."""
    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"while saving checkpoint iteration {iteration} to {checkpoint_dir}; {_previous_checkpoint(save_dir)}"
        ) from None
    except BaseException as raised:
        error = _write_failure(raised)
        if error is None:
            raise
        free = _free_bytes(checkpoint_dir)
        if isinstance(error, RuntimeError):
            full = free is not None and free < _NEARLY_FULL_BYTES
            code = errno.ENOSPC if full else errno.EIO
            cause = f"a write came up short{', the disk is full' if full else ''} (torch: {str(error).splitlines()[0]})"
        else:
            code, cause = error.errno or errno.EIO, error.strerror or str(error)
        space = "" if free is None else f" ({free / 2**20:,.1f} MiB free on that file system)"
        raise OSError(
            code,
            f"saving checkpoint iteration {iteration} to {checkpoint_dir} failed: {cause}{space}; "
            f"{_previous_checkpoint(save_dir)}",
        ) from raised
