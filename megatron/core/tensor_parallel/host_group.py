"""Small host-side values (sizes, shapes, flags) exchanged between the ranks of a group without the GPU.

A collective over an NCCL group needs its tensors on the GPU, and reading its result on the host
(`.item()`, `.tolist()`, `int(...)`) waits for every kernel queued before it: the CPU can then no longer
run ahead of the GPU, and each such read exposes the host's launch time. The same few integers sent
over a gloo twin of the group go from host to host and never wait for the GPU.

The twin has the group's ranks and is made on first use by those ranks only
(`use_local_synchronization`): ranks outside the group (other pipeline stages) need not take part. It
is kept by parallel_state with the other groups and freed with them (`destroy_model_parallel`), so no
gloo worker thread outlives a run. A gloo group is its own twin.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_gather_single

def host_group(group):
    """The gloo group of `group`'s ranks (`group` itself when it is a gloo group)."""
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    return parallel_state.gloo_twin(dist.get_process_group_ranks(group))


def broadcast_on_host(tensor: torch.Tensor, group, group_source: int = 0) -> torch.Tensor:
    """Broadcasts the CPU `tensor` (in place) from the group's rank `group_source` to its other ranks."""
    dist.broadcast(tensor, group=host_group(group), group_src=group_source)
    return tensor


def all_gather_ints_on_host(value: int, group) -> list[int]:
    """[value of group rank 0, value of group rank 1, ...]: every rank's `value`, on every rank."""
    gathered = torch.empty(dist.get_world_size(group), dtype=torch.int64)
    all_gather_single(gathered, torch.tensor([value], dtype=torch.int64), group=host_group(group))
    return gathered.tolist()
