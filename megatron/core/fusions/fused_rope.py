"""Rotary position embedding in one generated kernel: t * cos(theta) + rotate_half(t) * sin(theta).

The reference is `apply_rotary_pos_emb` (megatron/core/models/common/embeddings/rotary_pos_embedding.py);
fused, cos/sin of the angles [s, 1, 1, d'] are computed inside the kernel that reads t [s, b, heads, d]
once and writes the rotated tensor once, forward and backward (`--apply-rope-fusion`, Megatron's default
with RoPE).
"""

import torch

from megatron.core.fusions.cuda_fuser import cuda_fuser
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb


@cuda_fuser
def _rope_fused(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    return apply_rotary_pos_emb(t, freqs, rotary_interleaved=rotary_interleaved)


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None, rotary_interleaved: bool | None = None):
    """`apply_rotary_pos_emb` with the same arguments, one kernel on CUDA."""
    if rotary_interleaved is None:
        rotary_interleaved = bool(config is not None and config.rotary_interleaved)
    return _rope_fused(t, freqs.to(t.device), rotary_interleaved)
