"""The random-number state a checkpoint carries, so that a resumed run draws the same dropout masks and
the same random numbers as an uninterrupted one.

One entry per checkpoint holds every generator of this process:

    random_rng_state     python `random`
    np_rng_state         numpy's global RandomState
    torch_rng_state      torch's CPU generator
    cuda_rng_state       torch's CUDA generator (only when CUDA is available)
    rng_tracker_states   the tensor-parallel tracker's named streams (megatron.core.tensor_parallel.random)

`rng_state` is a list of such entries: one per data-parallel rank under --data-parallel-random-init
(each DP rank then has its own generators), else just this rank's.
"""

import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def get_rng_state(data_parallel_random_init: bool) -> list:
    """This process's generator states (gathered over the data-parallel group with data_parallel_random_init).

    Reads the generators without advancing them. Collective over the DP group when
    `data_parallel_random_init` and DP > 1.
    """
    rng_state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        rng_state["cuda_rng_state"] = torch.cuda.get_rng_state()
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    if not (data_parallel_random_init and dist.is_initialized() and data_parallel_size > 1):
        return [rng_state]
    rng_states = [None] * data_parallel_size
    dist.all_gather_object(rng_states, rng_state, group=parallel_state.get_data_parallel_group())
    return rng_states


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
    # A checkpoint written without CUDA has no CUDA state; a CPU run has no CUDA generator to restore.
    if torch.cuda.is_available() and "cuda_rng_state" in rng_state:
        torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(rng_state["rng_tracker_states"])
