"""YaRN's scalar formulas (yarn_rotary_pos_embedding.py has the maths), without torch or model code, so that the
checkpoint converter can use them too."""

import math


def yarn_get_mscale(scaling_factor: float = 1.0, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(s) + 1 for s > 1, else 1."""
    if scaling_factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_concentration_factor(scaling_factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """The factor on cos and sin: mscale(s, mscale) / mscale(s, mscale_all_dim)."""
    if mscale is None or mscale_all_dim is None:
        return yarn_get_mscale(scaling_factor)
    return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim)


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, rotary_base: float, original_max_position_embeddings: int,
    round_to_int: bool = True,
) -> tuple[float, float]:
    """(low, high) frequency indices of the blend (yarn_rotary_pos_embedding.py)."""

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(rotary_base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
