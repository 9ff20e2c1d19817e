"""The pieces of an FSDP-sharded param in a torch_dist checkpoint. FSDP2's (a DTensor holding this rank's rows
of the TP-local param): those of the whole TP-local param, cut to this rank's rows, so the checkpoint is the one
DDP writes (the same keys, global shapes and values) and reshards to and from any TP / DP layout.

A piece covering rows [p, p + m) of the TP-local param (dim 0; dim 1 of a stacked layer key) at global offset o
keeps, on the rank holding rows [a, b), rows [max(p, a), min(p + m, b)) at offset o + max(p, a) - p, read from
the local shard at row max(p, a) - a. Pieces of row-parallel params (split along dim 1) cover all rows.

The data-parallel ranks hold different rows, so no piece is replicated over them: each has the plain replica id
0 (written here) or 1 (another TP rank or pipeline stage holds the same rows), which keeps fully parallel
saving (fully_parallel.py) from handing a write to another data-parallel rank.

Megatron-FSDP's ZeRO-3 (distributed/fsdp/sharded_params.py) and the distributed optimizer's state hold a flat
stretch [s, e) of the TP-local param flattened: a piece whose elements [p, p + m) of the flattened param overlap it
becomes the flattened range [max(p, s) - p, min(p + m, e) - p) of that piece (`flat_stretch_pieces`), with the
data-parallel part of its replica id 0 for the same reason.
"""

import math
from dataclasses import replace
from typing import List

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, TensorPiece, is_main_replica
from megatron.core.dtensor_shards import local_rows, local_tensor


def shape_carrier(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of the DTensor's (TP-local) shape and dtype with its layout attributes (TP partition,
    `shared`, ...): the whole param's pieces are cut from it without any data."""
    carrier = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    for attribute, value in vars(tensor).items():
        if not attribute.startswith("_"):
            setattr(carrier, attribute, value)
    return carrier


def local_row_pieces(pieces: List[TensorPiece], tensor: torch.Tensor) -> List[TensorPiece]:
    """`pieces` of the whole TP-local param (cut from its `shape_carrier`), restricted to this rank's rows of
    the DTensor `tensor`, with data viewing its local shard and flat starts within that shard."""
    first, last = local_rows(tensor)
    local = local_tensor(tensor)
    row_numel = math.prod(tensor.shape[1:])
    restricted = []
    for piece, start in pieces:
        row_dim = len(piece.global_shape) - tensor.dim()  # 1 under a stacked layer axis
        piece_first = start // row_numel
        low, high = max(piece_first, first), min(piece_first + piece.local_shape[row_dim], last)
        if low >= high:
            continue
        columns = piece.data.shape[row_dim + 1:]
        data = local.narrow(0, low - first, high - low)
        if columns != data.shape[1:]:
            raise ValueError(f"{piece.key}: a piece of columns {tuple(columns)} of a param of shape "
                             f"{tuple(tensor.shape)} (a split along a dim other than 0 and 1 is not supported)")
        offset = list(piece.global_offset)
        offset[row_dim] += low - piece_first
        shape = list(piece.local_shape)
        shape[row_dim] = high - low
        replica_id = piece.replica_id[:-1] if isinstance(piece.replica_id, tuple) else (piece.replica_id,)
        restricted.append((replace(piece, data=data.unsqueeze(0) if row_dim else data, global_offset=tuple(offset),
                                   local_shape=tuple(shape), replica_id=0 if is_main_replica(replica_id) else 1),
                           (low - first) * row_numel))
    return restricted


def flat_stretch_pieces(pieces: List[TensorPiece], stretch: torch.Tensor, stretch_start: int,
                        key_prefix: str = "") -> List[TensorPiece]:
    """`pieces` of the whole TP-local param (their data is only read for its size) restricted to the flat stretch
    `stretch` (1-D) that starts at element `stretch_start` of the param flattened, with data viewing `stretch` and
    their keys prefixed by `key_prefix`; each with the flat start of its data within the param."""
    stretch_end = stretch_start + stretch.numel()
    restricted = []
    for piece, start in pieces:
        low, high = max(stretch_start, start), min(stretch_end, start + piece.data.numel())
        if low >= high:
            continue
        replica_id = (*piece.replica_id[:-1], 0) if isinstance(piece.replica_id, tuple) else piece.replica_id
        data = stretch[low - stretch_start : high - stretch_start]
        restricted.append((ShardedTensor(f"{key_prefix}{piece.key}", data,
                                         piece.global_shape, piece.global_offset, replica_id, piece.local_shape,
                                         slice(low - start, high - start), piece.allow_shape_mismatch), low))
    return restricted
