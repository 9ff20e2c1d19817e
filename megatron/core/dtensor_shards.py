"""This rank's part of a parameter sharded by FSDP2: a `DTensor` split along dim 0 over the data-parallel ranks.

`fully_shard` cuts each param's dim 0 like `torch.chunk` over the n ranks of its one-dimensional mesh:

    rows per rank  c = ceil(R / n)
    rank r holds   rows [min(r c, R), min((r + 1) c, R))      (the last ranks may hold fewer rows, or none)

so a [5, 8] weight over 2 ranks is [3, 8] on rank 0 and [2, 8] on rank 1. Gradient statistics, checkpoints and
the finalisation of gradients read this local piece; everything else sees the DTensor.
"""

import sys
from typing import Tuple

import torch


def is_fully_sharded(tensor) -> bool:
    """True for a DTensor (an FSDP-sharded param, its gradient or its optimizer state).

    torch.distributed.tensor is not imported for the check (over a second of start-up): while nothing has
    imported it (FSDP2, a torch_dist checkpoint), no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor, detached (a view: writing into it writes the shard); any other tensor as is."""
    return tensor.to_local().detach() if is_fully_sharded(tensor) else tensor


def local_rows(tensor) -> Tuple[int, int]:
    """[start, stop) of the rows of dim 0 that this rank holds (module docstring) of a DTensor `tensor`."""
    from torch.distributed.tensor import Shard  # loaded already: `tensor` is a DTensor

    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"expected a param sharded along dim 0 over one mesh dimension (FSDP2), got placements "
                         f"{tuple(tensor.placements)} on a {tensor.device_mesh.ndim}-D mesh")
    rows, ranks = tensor.shape[0], tensor.device_mesh.size()
    per_rank = -(-rows // ranks)
    start = min(tensor.device_mesh.get_local_rank() * per_rank, rows)
    stop = min(start + per_rank, rows)
    held = tensor.to_local().shape[0] if tensor.dim() else 0
    if held != stop - start:
        raise RuntimeError(f"a sharded param of {rows} rows holds {held} rows locally, expected rows [{start}, {stop}) "
                           f"of torch.chunk over {ranks} ranks")
    return start, stop
