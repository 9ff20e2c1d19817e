"""The save-time check that the ranks' pieces tile each global tensor, on hand-made DCP metadata."""

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron.core.dist_checkpointing.dcp_planners import _tiling_problems


def _metadata(size, *chunks):
    pieces = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
    tensor = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
                                   chunks=pieces)
    return Metadata(state_dict_metadata={"w": tensor, "args": BytesStorageMetadata()})


def test_two_row_halves_tile_the_tensor():
    assert _tiling_problems(_metadata((4, 3), ((0, 0), (2, 3)), ((2, 0), (2, 3)))) == []


def test_scalar_tensor_is_one_piece():
    assert _tiling_problems(_metadata((), ((), ()))) == []


def test_gap_is_reported():
    (problem,) = _tiling_problems(_metadata((4, 3), ((0, 0), (2, 3))))
    assert "w: the pieces cover 6 of 12 elements" == problem


def test_piece_outside_and_duplicate_offsets_are_reported():
    outside = _tiling_problems(_metadata((4, 3), ((0, 0), (2, 3)), ((3, 0), (2, 3))))
    assert any("lies outside the global shape (4, 3)" in p for p in outside)
    duplicate = _tiling_problems(_metadata((4, 3), ((0, 0), (2, 3)), ((0, 0), (2, 3))))
    assert duplicate == ["w: two pieces start at the same offset"]
