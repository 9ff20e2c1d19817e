"""This rank's part of a parameter sharded by FSDP2: a `DTensor` split along dim 0 over the data-parallel ranks.

`fully_shard` cuts each param's dim 0 like `torch.chunk` over the n ranks of its one-dimensional mesh:

    rows per rank  c = ceil(R / n)
    rank r holds   rows [min(r c, R), min((r + 1) c, R))      (the last ranks may hold fewer rows, or none)

so a [5, 8] weight over 2 ranks is [3, 8] on rank 0 and [2, 8] on rank 1. Gradient statistics, checkpoints and
the finalisation of gradients read this local piece; everything else sees the DTensor.
"""

from typing import Tuple

import torch
from torch.distributed.tensor import DTensor, Shard


def is_fully_sharded(tensor) -> bool:
    """True for a DTensor (an FSDP-sharded param, its gradient or its optimizer state)."""
    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor, detached (a view: writing into it writes the shard); any other tensor as is."""
    return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor


def local_rows(tensor: DTensor) -> Tuple[int, int]:
    """[start, stop) of the rows of dim 0 that this rank holds (module docstring)."""
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
