"""One run at a time per `--save` directory: `<save>/.save.lock` names the run that holds it.

Two runs saving into one directory interleave their iterations and leave checkpoints that are partly one
model and partly the other, and both exit 0. Global rank 0 takes the lock before the model is built and
holds it until the process ends (removed at exit):

    {"pid": 1234, "host": "node17", "process_start": 81234567, "started": "2026-11-27 10:00:00",
     "slurm_job": "4242", "command": "pretrain_gpt.py --save ckpt ..."}

A second run refuses to start while the holder lives, naming its pid and host. A lock whose holder is gone
is stale and taken over with a warning: on the same host, no process has that pid and start time (a run
that was killed leaves its lock); the same SLURM job started again (a requeued job). A lock from another
host cannot be checked from here: the message says how to remove it once that run is known to be over.
The same process taking the lock again (runs one after another in one interpreter) keeps it.
"""

import atexit
import json
import contextlib
import os
import socket
import sys
import time

from megatron.core.atomic_write import write_atomically
from megatron.training.processes import process_start

LOCK_NAME = ".save.lock"
_held = set()  # lock files this process holds


def _alive(holder: dict) -> bool:
    """Whether the process the lock names still runs (on this host)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    if os.path.isdir("/proc"):
        start, recorded = process_start(pid), holder.get("process_start")
        return start is not None and recorded in (None, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _this_process() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "process_start": process_start(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "command": " ".join(os.path.basename(word) if index == 0 else word for index, word in enumerate(sys.argv)),
    }


def _read(path: str) -> dict | None:
    try:
        with open(path) as stream:
            holder = json.load(stream)
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: a lock cut short; nobody can be named as its holder


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}: "
            f"{holder.get('command', '?')}")


def _stale_reason(holder: dict, me: dict) -> str | None:
    """Why the lock `holder` may be taken over, or None when its run may still be going."""
    if holder.get("host") == me["host"]:
        if holder.get("pid") == me["pid"] and holder.get("process_start") == me["process_start"]:
            return "this process"
        if not _alive(holder):
            return "its process is gone"
    if me["slurm_job"] is not None and holder.get("slurm_job") == me["slurm_job"]:
        return f"SLURM job {me['slurm_job']} was started again"
    return None


def acquire_save_lock(save_dir: str) -> None:
    """Takes the lock of `save_dir` (created if missing) for this process, or raises ValueError naming the
    run that holds it."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_NAME)
    me = _this_process()
    text = json.dumps(me, indent=1) + "\n"
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(descriptor, "w") as stream:
            stream.write(text)
    except FileExistsError:
        holder = _read(path) or {}
        reason = _stale_reason(holder, me)
        if reason is None:
            raise ValueError(
                f"--save {save_dir} is in use by another run ({_describe(holder)}): two runs saving into one "
                f"directory mix their checkpoints. Wait for it to end or give this run another --save; if that run "
                f"is over (it was on another host, or the lock is left from a crash there), delete {path}"
            ) from None
        if reason != "this process":
            print(f"warning: taking over the stale lock {path} of {_describe(holder)} ({reason})", flush=True)
            write_atomically(path, lambda stream: stream.write(text.encode()))
    if path not in _held:
        _held.add(path)
        atexit.register(release_save_lock, save_dir)


def release_save_lock(save_dir: str) -> None:
    """Removes the lock of `save_dir` if this process holds it."""
    path = os.path.join(save_dir, LOCK_NAME)
    if path not in _held:
        return
    _held.discard(path)
    holder = _read(path)
    me = _this_process()
    if holder and holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
        # OSError: the directory went away (a test's scratch directory), so nothing is left to release.
        with contextlib.suppress(OSError):
            os.remove(path)
