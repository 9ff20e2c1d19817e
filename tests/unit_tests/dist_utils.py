"""Run a function on N CPU ranks (gloo), or N GPUs (NCCL), from inside a pytest test.

    results = run_distributed(my_check, world_size=4, arg1, arg2)

`my_check(rank, world_size, *args)` must be a module-level function (it is pickled by reference). Each
rank gets `torch.distributed` initialised with gloo over a file store; the return values come back as
a list indexed by rank. An exception on any rank fails the test with that rank's traceback.

The ranks are forked from a server process that imported torch (with torch._dynamo, which the first
optimizer step imports) and the training code once, when the first ranks of this pytest process start
(`fresh_process_context`). A spawned rank spent ~3.5 s of CPU on those imports, and the suite starts
~120 ranks: on a 2-core CI machine that was the largest single cost of the run. Each rank is still a fresh
process that has only imported modules, as under spawn; it runs with the caller's environment of the
moment, and takes `fn` and `args` by value (plain pickle), so a tensor argument is copied, not shared.
"""

import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "megatron.core.parallel_state",
              "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
              "megatron.training.training"]


def fresh_process_context():
    """The multiprocessing context of the ranks: fresh processes forked from one that has imported
    `_PRELOADED` (module docstring)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOADED)
    return context


def _worker(rank, world_size, store_path, call, environment, queue, backend):
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        fn, args = pickle.loads(call)
        # Pickled here, by value: a tensor put on the queue as it is travels as a shared-memory handle
        # that the parent cannot open any more once this process has exited (FileNotFoundError).
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # the parent reports it; a bare exit would hide the cause
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo"):
    """Runs `fn(rank, world_size, *args)` on `world_size` fresh ranks (gloo; with backend="nccl" rank r on
    GPU r); returns results by rank."""
    context = fresh_process_context()
    queue = context.Queue()
    # By value: the forkserver passes a process's file descriptors in one message of at most 256, and
    # multiprocessing's own pickler would send each tensor of `args` as one.
    call = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        processes = [
            context.Process(target=_worker, args=(rank, world_size, store_path, call, dict(os.environ), queue, backend))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results, errors = {}, []
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors.append(f"rank {rank} failed:\n{payload}")
                    break
        finally:
            for process in processes:
                process.join(timeout=5 if errors else 60)
                if process.is_alive():
                    process.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[rank] for rank in range(world_size)]
