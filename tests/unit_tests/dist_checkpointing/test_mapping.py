"""ShardedTensor geometry, worked by hand: Megatron's even-split constructor, the boxes that tile a
flattened range (the distributed optimizer's stretch of a param), and which data-parallel rank writes a
replicated piece."""

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.fully_parallel import distribute_replica_writes
from megatron.core.dist_checkpointing.mapping import flat_range_boxes


def test_from_rank_offsets_places_an_even_split():
    piece = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), (0, 1, 2))
    assert (piece.global_shape, piece.global_offset) == ((6, 4), (3, 0))


def test_a_piece_outside_its_global_tensor_is_refused():
    with pytest.raises(ValueError, match="a piece of shape \\(3, 4\\) at \\(4, 0\\) does not fit in the global "
                                         "shape \\(6, 4\\)"):
        ShardedTensor("w", torch.zeros(3, 4), (6, 4), (4, 0))


def test_flat_range_of_a_matrix_is_a_partial_row_whole_rows_and_a_partial_row():
    # Elements 2..10 of a 3 x 4 matrix: row 0 cols 2-3, row 1 whole, row 2 cols 0-2.
    assert flat_range_boxes((3, 4), 2, 11) == [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 3), 8)]
    assert flat_range_boxes((3, 4), 4, 12) == [((1, 0), (2, 4), 4)]
    assert flat_range_boxes((3, 4), 5, 7) == [((1, 1), (1, 2), 5)]
    assert flat_range_boxes((10,), 3, 7) == [((3,), (4,), 3)]


def test_boxes_of_a_flattened_piece_hold_its_elements_at_their_global_place():
    # Rows 2..4 of a 6 x 4 tensor live on this rank; it holds flat elements 2..10 of them.
    local = torch.arange(12.0).view(3, 4)
    stretch = local.view(-1)[2:11]
    piece = ShardedTensor("w", stretch, (6, 4), (2, 0), local_shape=(3, 4), flattened_range=slice(2, 11))
    rebuilt = torch.full((6, 4), -1.0)
    for offset, box in piece.boxes():
        rebuilt[offset[0] : offset[0] + box.shape[0], offset[1] : offset[1] + box.shape[1]] = box
    expected = torch.full((6, 4), -1.0)
    expected[2:5].view(-1)[2:11] = stretch
    assert torch.equal(rebuilt, expected)


def test_replicated_pieces_are_spread_over_data_parallel_ranks_by_size():
    def pieces(data_parallel_rank):
        return [ShardedTensor(key, torch.zeros(size), (size,), (0,), (0, 0, data_parallel_rank))
                for key, size in (("a", 8), ("b", 6), ("c", 4), ("d", 1))]

    writers = {}
    for rank in range(2):
        rank_pieces = pieces(rank)
        distribute_replica_writes(rank_pieces, rank, 2)
        writers.update({piece.key: rank for piece in rank_pieces if is_main_replica(piece.replica_id)})
    # Largest first to the least loaded rank: a -> 0 (8), b -> 1 (6), c -> 1 (10), d -> 0 (9).
    assert writers == {"a": 0, "b": 1, "c": 1, "d": 0}


def test_sharded_object_key_names_its_place_in_the_grid():
    assert ShardedObject("rng_state", None, (2, 4), (1, 3)).unique_key == "rng_state/shard_1.3_2.4"
