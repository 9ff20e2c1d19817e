"""A weight split over TP in unequal blocks (Gated DeltaNet's fused in_proj [q; k; v; z; beta; alpha],
`partition_sections`) is stored as the TP=1 weight: the TP ranks' pieces, placed at their global offsets,
rebuild it exactly, and each piece is the stretch of the flattened local tensor that its flat offset names."""

import torch

from megatron.core.dist_checkpointing.model_sharding import _partitioned_pieces
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

SECTIONS = (4, 4, 8, 8, 2, 2)


def test_sectioned_pieces_rebuild_the_full_weight():
    full = torch.arange(sum(SECTIONS) * 3, dtype=torch.float32).view(-1, 3)
    for tp in (1, 2):
        rebuilt = torch.full_like(full, float("nan"))
        for rank in range(tp):
            local = torch.cat([block.chunk(tp)[rank] for block in full.split(SECTIONS)])
            set_tensor_model_parallel_attributes(local, tp > 1, 0, SECTIONS)
            pieces = _partitioned_pieces("in_proj.weight", local, [local.size(0)] * tp, rank, (0, 0, 0), False, None)
            assert len(pieces) == len(SECTIONS)
            for piece, flat_offset in pieces:
                assert piece.global_shape == tuple(full.shape)
                assert torch.equal(local.flatten()[flat_offset : flat_offset + piece.data.numel()], piece.data.flatten())
                start = piece.global_offset[0]
                rebuilt[start : start + piece.local_shape[0]] = piece.data
        assert torch.equal(rebuilt, full)
