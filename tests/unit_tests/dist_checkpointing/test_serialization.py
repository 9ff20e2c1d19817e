"""save/load on one process: what goes to the common state (an object in the DCP files, as Megatron-Core
writes it) and what to DCP tensors, and padded dimensions (the vocabulary,
padded to a multiple of 128 x TP) loading across paddings: the rows both have are read, the others keep
their values; any other shape difference is refused by name."""

import os

import pytest
import torch

from megatron.core.dist_checkpointing import (
    ShardedObject,
    ShardedTensor,
    load,
    load_common_state_dict,
    save,
    saved_keys,
)


def _embedding(rows: int, fill: float, allow_shape_mismatch: bool = True) -> ShardedTensor:
    weight = torch.full((rows, 2), fill)
    return ShardedTensor("embedding.word_embeddings.weight", weight, (rows, 2), (0, 0),
                         allow_shape_mismatch=allow_shape_mismatch)


@pytest.fixture
def checkpoint(tmp_path):
    weight = torch.arange(16.0).view(8, 2)
    save({"model": {"embedding": ShardedTensor("embedding.word_embeddings.weight", weight, (8, 2), (0, 0))},
          "rng": ShardedObject("rng_state", {"seed": 5}, (1,), (0,)), "iteration": 7, "args": {"lr": 0.1}},
         str(tmp_path))
    return str(tmp_path)


def test_common_part_and_objects_round_trip(checkpoint):
    # A dict whose entries are all sharded is left out of the common part, as in Megatron-Core.
    assert load_common_state_dict(checkpoint) == {"iteration": 7, "args": {"lr": 0.1}}
    assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "metadata.json"]
    assert saved_keys(checkpoint) == {"common_state/shard_0_1", "rng_state/shard_0_1",
                                      "embedding.word_embeddings.weight"}
    loaded = load({"model": {"embedding": _embedding(8, 0.0)}, "rng": ShardedObject("rng_state", None, (1,), (0,))},
                  checkpoint)
    assert torch.equal(loaded["model"]["embedding"], torch.arange(16.0).view(8, 2))
    assert loaded["rng"] == {"seed": 5} and loaded["iteration"] == 7


@pytest.mark.parametrize("rows", [12, 6])
def test_padded_rows_load_across_paddings(checkpoint, rows):
    piece = _embedding(rows, -1.0)
    load({"embedding": piece}, checkpoint)
    shared = min(rows, 8)
    assert torch.equal(piece.data[:shared], torch.arange(16.0).view(8, 2)[:shared])
    assert torch.equal(piece.data[shared:], torch.full((rows - shared, 2), -1.0))


def test_other_shape_differences_are_refused(checkpoint):
    with pytest.raises(ValueError, match="global shapes differ: embedding.word_embeddings.weight: checkpoint "
                                         "\\(8, 2\\), this run \\(12, 2\\)"):
        load({"embedding": _embedding(12, 0.0, allow_shape_mismatch=False)}, checkpoint)
