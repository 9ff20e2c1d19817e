"""`pretrain_gpt.py` (or the entry script FAULT_SCRIPT names) with one fault injected, for the fault-injection
tests (run as each rank).

    FAULT=<kind>:<rank>:<iteration> python fault_injection_entry.py <pretrain_gpt.py flags>  (RANK, WORLD_SIZE, ... set)

    kill_mid_iteration   SIGKILL during the second microbatch of the iteration
    kill_mid_save        SIGKILL half-way through writing this rank's checkpoint file of the iteration
    disk_full            that write fails with ENOSPC ("No space left on device") half-way
    nan_grad             the rank's gradients become NaN in the iteration (its loss stays finite)

Faults are patched in from outside: the framework carries no test hooks.
"""

import errno
import io
import os
import runpy
import signal
import sys

import torch
import torch.distributed as dist

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from megatron.core.atomic_write import write_atomically  # noqa: E402
from megatron.training import trainer  # noqa: E402
from megatron.training.checkpointing import saving  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402

KIND, RANK, ITERATION = os.environ["FAULT"].split(":")
RANK, ITERATION = int(RANK), int(ITERATION)


def _this_rank() -> bool:
    return dist.get_rank() == RANK


def _write_half_then(fail):
    def save_atomically(obj, filename):
        if not (_this_rank() and isinstance(obj, dict) and obj.get("iteration") == ITERATION):
            return write_atomically(filename, lambda file: torch.save(obj, file))
        payload = io.BytesIO()
        torch.save(obj, payload)

        def write(file):
            file.write(payload.getvalue()[: len(payload.getvalue()) // 2])
            file.flush()
            fail()

        return write_atomically(filename, write)

    return save_atomically


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _disk_full():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _faulty_forward_step(forward_step_func):
    calls = []

    def forward_step(data_iterator, model):
        calls.append(1)
        if KIND == "kill_mid_iteration" and len(calls) == 2:
            _kill()
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if KIND == "nan_grad":
            output_tensor.register_hook(lambda grad: grad * float("nan"))
        return output_tensor, loss_func

    return forward_step


_run_train_step = trainer.run_train_step
_steps = []


def run_train_step(forward_step_func, *args, **kwargs):
    _steps.append(1)
    iteration = get_args().iteration + len(_steps)  # args.iteration: where the run started
    if iteration == ITERATION and _this_rank():
        forward_step_func = _faulty_forward_step(forward_step_func)
    return _run_train_step(forward_step_func, *args, **kwargs)


if KIND in ("kill_mid_iteration", "nan_grad"):
    trainer.run_train_step = run_train_step
elif KIND in ("kill_mid_save", "disk_full"):
    saving.save_atomically = _write_half_then(_kill if KIND == "kill_mid_save" else _disk_full)
else:
    raise ValueError(f"FAULT kind {KIND!r}: expected kill_mid_iteration, kill_mid_save, disk_full or nan_grad")

sys.argv = [os.path.join(ROOT, os.environ.get("FAULT_SCRIPT", "pretrain_gpt.py")), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
