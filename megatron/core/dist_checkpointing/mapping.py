"""What a sharded state dict holds: pieces of global tensors (`ShardedTensor`) and per-rank objects
(`ShardedObject`), under Megatron-Core's names.

A `ShardedTensor` says where this rank's `data` sits inside a global tensor that no rank holds whole:

    global tensor  [global_shape]                       e.g. linear_qkv.weight  [3h, h]
    this piece     [local_shape] at global_offset       TP rank 1 of 2:          [3h/2, h] at (3h/2, 0)

With `flattened_range` the rank holds only elements [start, stop) of the piece flattened (the
distributed optimizer's shard of a param); `data` is then 1-D. `replica_id` is 0 (or all zeros) on the
one rank that writes the piece; copies on other ranks (data-parallel replicas, norms repeated on every
tensor-parallel rank) carry a non-zero id and are only read.
"""

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple, Union

import torch

ReplicaId = Union[int, Tuple[int, ...]]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the copy that is written: replica id 0, or all zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(part == 0 for part in replica_id)


@dataclass
class ShardedTensor:
    """This rank's piece of the global tensor `key` (see the module docstring)."""

    key: str
    data: torch.Tensor
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0
    local_shape: Optional[Tuple[int, ...]] = None
    flattened_range: Optional[slice] = None
    # Padded dimensions (the vocabulary) may differ between the checkpoint and this run: the overlap loads.
    allow_shape_mismatch: bool = False

    def __post_init__(self):
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        self.local_shape = tuple(self.data.shape if self.local_shape is None else self.local_shape)
        if len(self.global_offset) != len(self.global_shape) or len(self.local_shape) != len(self.global_shape):
            raise ValueError(
                f"sharded tensor {self.key}: global shape {self.global_shape}, offset {self.global_offset} and local "
                f"shape {self.local_shape} must have the same number of dimensions"
            )
        for offset, size, total in zip(self.global_offset, self.local_shape, self.global_shape):
            if offset < 0 or offset + size > total:
                raise ValueError(
                    f"sharded tensor {self.key}: a piece of shape {self.local_shape} at {self.global_offset} does "
                    f"not fit in the global shape {self.global_shape}"
                )
        if self.flattened_range is not None:
            length = self.flattened_range.stop - self.flattened_range.start
            if self.data.dim() != 1 or self.data.numel() != length:
                raise ValueError(
                    f"sharded tensor {self.key}: a flattened range of {length} elements needs 1-D data of that "
                    f"length, got shape {tuple(self.data.shape)}"
                )

    @classmethod
    def from_rank_offsets(cls, key: str, data: torch.Tensor, *rank_offsets, replica_id: ReplicaId = 0, **kwargs):
        """Megatron's constructor for even splits: each `(axis, rank, fragments)` says that `data` is piece
        `rank` of `fragments` equal pieces along `axis`, so global size = local size x fragments there."""
        global_shape, global_offset = list(data.shape), [0] * data.dim()
        for axis, rank, fragments in rank_offsets:
            global_shape[axis] = data.shape[axis] * fragments
            global_offset[axis] = data.shape[axis] * rank
        return cls(key, data, tuple(global_shape), tuple(global_offset), replica_id, **kwargs)

    def with_data(self, data: torch.Tensor, flattened_range: Optional[slice] = None) -> "ShardedTensor":
        """The same place in the global tensor holding `data` (e.g. an optimizer moment of a param)."""
        return replace(self, data=data, flattened_range=flattened_range)

    def boxes(self) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
        """(global offset, tensor of the box's shape) for each box this piece covers: one for a whole
        piece; for a flattened range, the few boxes that tile it (partial row, whole rows, partial row)."""
        if self.flattened_range is None:
            return [(self.global_offset, self.data)]
        start = self.flattened_range.start
        return [
            (tuple(base + offset for base, offset in zip(self.global_offset, offsets)),
             self.data[flat_start - start : flat_start - start + math.prod(sizes)].view(sizes))
            for offsets, sizes, flat_start in flat_range_boxes(self.local_shape, start, self.flattened_range.stop)
        ]


def flat_range_boxes(shape: Tuple[int, ...], start: int, stop: int) -> List[Tuple[tuple, tuple, int]]:
    """Tiles elements [start, stop) of a row-major tensor of `shape` with boxes: (offsets, sizes, flat
    index of the box's first element). E.g. shape (3, 4), [2, 11): row 0 cols 2-3, row 1, row 2 cols 0-2."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (stop - 1) // inner

    def in_row(row, row_start, row_stop):
        return [((row, *offsets), (1, *sizes), row * inner + flat)
                for offsets, sizes, flat in flat_range_boxes(shape[1:], row_start, row_stop)]

    if first_row == last_row:
        return in_row(first_row, start - first_row * inner, stop - first_row * inner)
    boxes = []
    whole_from, whole_to = first_row, last_row + 1
    if start % inner:
        boxes += in_row(first_row, start % inner, inner)
        whole_from += 1
    if stop % inner:
        whole_to -= 1
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from, *shape[1:]), whole_from * inner))
    if stop % inner:
        boxes += in_row(last_row, 0, stop % inner)
    return boxes


# A piece of a model tensor and where its first element sits in that tensor, flattened.
TensorPiece = Tuple[ShardedTensor, int]


@dataclass
class ShardedObject:
    """A picklable object of which each rank holds the piece at `global_offset` of a `global_shape` grid
    (e.g. the RNG state of each pipeline x tensor-parallel rank), stored as
    `{key}/shard_{offset}_{shape}` as in Megatron-Core."""

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    @property
    def unique_key(self) -> str:
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"
