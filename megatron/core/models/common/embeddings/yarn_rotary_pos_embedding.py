"""YaRN rotary embedding (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as DeepSeek-V2/V3
and Megatron-Core's multi-latent attention use it.

For rotary dimension d, base b and frequency index i (wavelength 2 pi / theta_i, theta_i = b^(-2i/d)), YaRN
blends the original frequency ("extrapolation") with the frequency divided by the scaling factor s
("interpolation"):

    theta'_i = theta_i / s * (1 - m_i) + theta_i * m_i,   m_i = 1 - clamp((i - low) / (high - low), 0, 1)

where low/high are the indices at which a wavelength makes beta_fast / beta_slow turns over the original
context L (`original_max_position_embeddings`):

    dim(n) = d * log(L / (2 pi n)) / (2 log b),   low = floor(dim(beta_fast)),   high = ceil(dim(beta_slow))

(clamped to [0, d - 1]; not rounded without `correction_range_round_to_int`). High-frequency pairs
(i < low) keep their frequency, low-frequency ones (i > high) are interpolated by s.

The concentration factor ("mscale", `yarn_concentration_factor`) multiplies cos and sin, so q.k of the
rotated parts scales by its square:

    yarn_get_mscale(s, m) = 0.1 m ln(s) + 1  (1 for s <= 1)
    concentration = yarn_get_mscale(s, mscale) / yarn_get_mscale(s, mscale_all_dim)

Multi-latent attention also multiplies its softmax scale by yarn_get_mscale(s, mscale_all_dim)^2, so that
with mscale == mscale_all_dim (DeepSeek-V3) the rotated part keeps the same temperature and the un-rotated
part gets the larger one.
"""

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.yarn import yarn_concentration_factor, yarn_correction_range, yarn_get_mscale

__all__ = ["YarnRotaryEmbedding", "yarn_concentration_factor", "yarn_correction_range", "yarn_get_mscale"]


class YarnRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding with YaRN frequencies; `forward` returns (angles [s, 1, 1, d], concentration factor),
    Megatron-Core's contract (the factor multiplies cos and sin where the angles are applied)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000.0,
        use_cpu_initialization: bool = False,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
    ):
        if rotary_interleaved:
            raise ValueError("YaRN RoPE does not support interleaved rotary embeddings (as in Megatron-Core)")
        super().__init__(
            kv_channels, rotary_percent, seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base, use_cpu_initialization=use_cpu_initialization,
        )
        dim = 2 * self.inv_freq.numel()
        extrapolation = self.inv_freq
        interpolation = extrapolation / scaling_factor
        low, high = yarn_correction_range(
            beta_fast, beta_slow, dim, rotary_base, original_max_position_embeddings, correction_range_round_to_int
        )
        if low == high:
            high += 0.001  # the ramp needs a non-empty range
        index = torch.arange(dim // 2, dtype=torch.float32, device=extrapolation.device)
        keep = 1.0 - torch.clamp((index - low) / (high - low), 0, 1)  # m_i: 1 = original frequency
        self.inv_freq = interpolation * (1 - keep) + extrapolation * keep
        self.mscale = yarn_concentration_factor(scaling_factor, mscale, mscale_all_dim)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False):
        return super().forward(max_seq_len, offset, packed_seq), self.mscale
