"""The random-number state a checkpoint carries, so that a resumed run draws the same dropout masks and
the same random numbers as an uninterrupted one.

One entry per checkpoint holds every generator of this process (Megatron-LM's keys):

    random_rng_state        python `random`
    np_rng_state            numpy's global RandomState
    torch_rng_state         torch's CPU generator
    cuda_rng_state          torch's CUDA generator
    rng_tracker_states      the tensor-parallel tracker's named streams (megatron.core.tensor_parallel.random)
    cpu_rng_tracker_states  (written on a CPU only) the tracker's streams as this CPU run had them

A CUDA generator state is 16 bytes: the seed and the Philox offset, each 64 bits little-endian. On a CPU
the tracker's streams are CPU generators, which no GPU can continue; so a checkpoint written on a CPU gives
`cuda_rng_state` and `rng_tracker_states` as CUDA states at offset 0 of the seeds they were started from
(what the GPU run would have had at its start), which Megatron-LM requires and accepts, and keeps the CPU
streams under `cpu_rng_tracker_states` for a CPU run that resumes it. A run on the other kind of device
than the one that saved the checkpoint cannot continue its streams and keeps its own (it says so once).

`rng_state` is a list of such entries: one per data-parallel rank under --data-parallel-random-init
(each DP rank then has its own generators), else just this rank's.
"""

import random
import struct

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.training.console import print_rank_0


def get_rng_state(data_parallel_random_init: bool) -> list:
    """This process's generator states (gathered over the data-parallel group with data_parallel_random_init).

    Reads the generators without advancing them. Collective over the DP group when
    `data_parallel_random_init` and DP > 1.
    """
    tracker = get_cuda_rng_tracker()
    rng_state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng_state["cuda_rng_state"] = torch.cuda.get_rng_state()
        rng_state["rng_tracker_states"] = tracker.get_states()
    else:
        seed = tracker.default_seed if tracker.default_seed is not None else torch.initial_seed()
        rng_state["cuda_rng_state"] = cuda_generator_state(seed)
        rng_state["rng_tracker_states"] = {name: cuda_generator_state(tracker.stream_seeds[name])
                                           for name in tracker.get_states()}
        rng_state["cpu_rng_tracker_states"] = tracker.get_states()
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    if not (data_parallel_random_init and dist.is_initialized() and data_parallel_size > 1):
        return [rng_state]
    rng_states = [None] * data_parallel_size
    dist.all_gather_object(rng_states, rng_state, group=parallel_state.get_data_parallel_group())
    return rng_states


CUDA_STATE_BYTES = 16


def cuda_generator_state(seed: int, offset: int = 0) -> torch.Tensor:
    """The state `torch.cuda.get_rng_state()` returns after `torch.cuda.manual_seed(seed)` (offset 0):
    uint8 [16] = seed, Philox offset, each int64 little-endian."""
    return torch.frombuffer(bytearray(struct.pack("<Qq", seed % 2**64, offset)), dtype=torch.uint8).clone()


def _is_cuda_state(state) -> bool:
    return isinstance(state, torch.Tensor) and state.numel() == CUDA_STATE_BYTES


def _tracker_states_for_this_device(rng_state: dict):
    """The tracker streams of `rng_state` this run's device can continue, or None (then the run keeps its
    own): CUDA states on a GPU, CPU generator states on a CPU."""
    on_gpu = torch.cuda.is_available()
    candidates = [rng_state.get("rng_tracker_states")]
    if not on_gpu:
        candidates.insert(0, rng_state.get("cpu_rng_tracker_states"))
    for states in candidates:
        if states and all(_is_cuda_state(state) == on_gpu for state in states.values()):
            return states
    return None


_reported_other_device: list = []


def _missing_rng_state(checkpoint_name: str, what: str) -> ValueError:
    return ValueError(
        f"checkpoint {checkpoint_name} has no {what} (was it saved with --no-save-rng?); pass --no-load-rng "
        "(or --finetune) to start from this run's seeds instead"
    )


def set_rng_state(state_dict: dict, data_parallel_random_init: bool, checkpoint_name: str) -> None:
    """Restores the generators from a checkpoint's state dict.

    Under data_parallel_random_init each DP rank takes its own entry; otherwise every rank takes entry 0.
    Checkpoints older than the `rng_state` list keep one entry's keys at the top level.
    """
    if "rng_state" in state_dict:
        rng_states = state_dict["rng_state"]
    elif "random_rng_state" in state_dict:
        rng_states = [state_dict]
    else:
        raise _missing_rng_state(checkpoint_name, "RNG state")
    index = parallel_state.get_data_parallel_rank() if data_parallel_random_init else 0
    if index >= len(rng_states):
        raise ValueError(
            f"checkpoint {checkpoint_name} holds RNG states of {len(rng_states)} data-parallel rank(s), this run "
            f"needs the one of data-parallel rank {index} (--data-parallel-random-init): it was saved without "
            "--data-parallel-random-init or with fewer data-parallel ranks; pass --no-load-rng"
        )
    rng_state = rng_states[index]
    if not rng_state.get("rng_tracker_states"):
        raise _missing_rng_state(checkpoint_name, "tensor-parallel RNG tracker states")
    random.setstate(rng_state["random_rng_state"])
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    # A CPU run has no CUDA generator to restore.
    if torch.cuda.is_available() and _is_cuda_state(rng_state.get("cuda_rng_state")):
        torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
    tracker_states = _tracker_states_for_this_device(rng_state)
    if tracker_states is not None:
        get_cuda_rng_tracker().set_states(tracker_states)
    elif not _reported_other_device:
        _reported_other_device.append(checkpoint_name)
        saved_on = "a CPU" if torch.cuda.is_available() else "a GPU"
        print_rank_0(
            f"note: {checkpoint_name} was saved on {saved_on}, whose tensor-parallel RNG streams this device cannot "
            "continue: this run's own seeded streams are used (dropout masks differ from the saving run's)"
        )
