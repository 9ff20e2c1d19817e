"""One error convention for every entry point: `pretrain_*.py`, the tools, `python -m megatron doctor`.

    if __name__ == "__main__":
        run_entry_point(main)            # or run_entry_point(pretrain, provider, ...)

A *user error* (bad flags, files, data, checkpoints, a full disk) prints one line, `error: <message>`, on
stderr and exits with status 1 (2 for a command line argparse cannot parse, 130 for Ctrl-C), without a
traceback. Anything else (a bug here, a failure inside torch) keeps its traceback. `MEGATRON_TRACEBACK=1`
shows the traceback of user errors too.

What counts as a user error:
  - a ValueError or NotImplementedError raised on purpose by this project: the innermost frame of its
    traceback is a `raise` statement in the `megatron` package or `tools/` (checks raise these with the
    flag, the file and the valid values in the message);
  - an OSError about the environment (missing file, permission, full disk, read-only file system), wherever
    it was raised;
  - under torch.distributed, a rank that lost its connection to a rank that stopped: the root cause is the
    other rank's message, so this one says only that.

Under torchrun every rank usually meets the same error at the same time. A message is printed once per
host and launch: the first rank to report it claims it with an empty marker file (O_EXCL) named by the
hash of the message and of the launch (torchrun's agent process, MASTER_ADDR/PORT, SLURM job and step);
the others exit quietly with the same status. Different messages (a checkpoint file that only one tensor-
parallel rank cannot read) are each printed.
"""

import argparse
import errno
import hashlib
import linecache
import contextlib
import os
import sys
import tempfile
import time

_TRACEBACK_VARIABLE = "MEGATRON_TRACEBACK"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT_DIRS = (_PACKAGE_DIR + os.sep, os.path.join(os.path.dirname(_PACKAGE_DIR), "tools") + os.sep)
# OSErrors that describe the machine or the user's paths, not a bug.
_ENVIRONMENT_ERRNOS = {
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EISDIR,
    errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ENOTEMPTY, errno.EXDEV,
}
# What gloo and NCCL say on a rank whose peer died.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")
PEER_GONE_MESSAGE = ("another rank stopped (its error is above) and this rank lost its connection to it; "
                     "run with MEGATRON_TRACEBACK=1 for this rank's traceback")
_MARKER_LIFETIME_SECONDS = 24 * 3600
_LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT",
                     "SLURM_JOB_ID", "SLURM_STEP_ID")


def traceback_requested() -> bool:
    """MEGATRON_TRACEBACK=1 (any value but empty or 0): user errors keep their traceback."""
    return os.environ.get(_TRACEBACK_VARIABLE, "") not in ("", "0")


def _innermost_frame(error: BaseException):
    trace = error.__traceback__
    if trace is None:
        return None
    while trace.tb_next is not None:
        trace = trace.tb_next
    return trace


def _raised_on_purpose(error: BaseException) -> bool:
    """True when the innermost frame is a `raise` statement in this project's code."""
    trace = _innermost_frame(error)
    if trace is None:
        return False
    filename = os.path.abspath(trace.tb_frame.f_code.co_filename)
    if not filename.startswith(_PROJECT_DIRS):
        return False
    return linecache.getline(filename, trace.tb_lineno).lstrip().startswith("raise")


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def user_error_message(error: BaseException) -> str | None:
    """The message to print for `error` when it is a user error (see the module docstring), else None."""
    if isinstance(error, OSError) and (error.errno in _ENVIRONMENT_ERRNOS or _raised_on_purpose(error)):
        # "[Errno 28] <our sentence>" reads better as the sentence; keep the file name when there is one.
        return str(error) if error.filename is not None or not error.strerror else error.strerror
    if isinstance(error, (ValueError, NotImplementedError)) and _raised_on_purpose(error):
        return str(error)
    if isinstance(error, RuntimeError) and _world_size() > 1 and any(text in str(error) for text in _PEER_GONE):
        return PEER_GONE_MESSAGE
    return None


def _launch_key() -> str:
    """What the ranks of one launch on one host share: torchrun's agent is the parent of every local rank
    (told apart from a later process with its pid by its start time)."""
    from megatron.training.processes import process_start

    parent = os.getppid()
    return "|".join([os.environ.get(name, "") for name in _LAUNCH_VARIABLES] + [f"{parent}@{process_start(parent)}"])


def _claim(message: str) -> bool:
    """True for the first rank of this launch and host to report `message` (always True for one process)."""
    if _world_size() <= 1:
        return True
    directory = os.path.join(tempfile.gettempdir(), f"megatron-errors-{os.getuid()}")
    marker = hashlib.sha256(f"{_launch_key()}|{message}".encode()).hexdigest()[:32]
    try:
        os.makedirs(directory, exist_ok=True)
        now = time.time()
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):  # another rank removed it first
                if now - os.path.getmtime(path) > _MARKER_LIFETIME_SECONDS:
                    os.remove(path)
        os.close(os.open(os.path.join(directory, marker), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True  # no usable temporary directory: print rather than lose the message
    return True


def report_error(message: str) -> None:
    """Prints `error: <message>` on stderr, once per launch and host (see the module docstring)."""
    if _claim(message):
        print(f"error: {message}", file=sys.stderr, flush=True)


def report_user_error(error: BaseException) -> bool:
    """Prints `error` as `error: <message>` and returns True when it is a user error and no traceback was
    asked for; returns False (print nothing) otherwise, for the caller to re-raise. For tools whose
    `main()` returns an exit status: `except Exception as error: if not report_user_error(error): raise`."""
    message = user_error_message(error)
    if message is None or traceback_requested():
        return False
    report_error(message)
    return True


def run_entry_point(function, *args, **kwargs):
    """Runs `function(*args, **kwargs)` under the convention; exits with its return value when that is a
    non-zero status, returns normally otherwise (so `runpy` callers go on after a finished run)."""
    try:
        status = function(*args, **kwargs)
    except KeyboardInterrupt as error:
        if traceback_requested():
            raise
        report_error(f"interrupted{': ' + str(error) if str(error) else ''}")
        sys.exit(130)
    except Exception as error:
        if not report_user_error(error):
            raise
        sys.exit(1)
    if isinstance(status, int) and status != 0:
        sys.exit(status)
    return status


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors follow the convention: `error: <message>` once per job, exit status 2 (argparse
    prints the whole usage first, which for the training flags is hundreds of lines; --help shows it)."""

    def error(self, message: str):
        report_error(f"{message} (see {self.prog} --help)")
        sys.exit(2)
