"""RotaryEmbedding against Hugging Face's LlamaRotaryEmbedding (default, linear and Llama-3.1 scaling)
and against RoFormer's complex-number form for the interleaved layout."""

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb

HEAD_DIM, POSITIONS = 16, 9000  # positions beyond 8192 reach the Llama-3.1 scaling regime
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_cos_sin(rope_theta, rope_scaling=None):
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 2, num_attention_heads=2, rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=16384,
    )
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(POSITIONS)[None])
    return cos[0], sin[0]  # [s, d]


@pytest.mark.parametrize(
    "rope_theta, hf_scaling, ours",
    [
        (10000.0, None, {}),
        (10000.0, {"rope_type": "linear", "factor": 4.0}, {"seq_len_interpolation_factor": 4.0}),
        (500000.0, LLAMA3, {"rope_scaling": True, "rope_scaling_factor": 8.0}),
    ],
)
def test_angles_match_transformers(rope_theta, hf_scaling, ours):
    cos, sin = _hf_cos_sin(rope_theta, hf_scaling)
    angles = RotaryEmbedding(HEAD_DIM, 1.0, rotary_base=rope_theta, **ours)(POSITIONS)
    assert angles.shape == (POSITIONS, 1, 1, HEAD_DIM)
    torch.testing.assert_close(angles[:, 0, 0].cos(), cos, atol=2e-4, rtol=0)
    torch.testing.assert_close(angles[:, 0, 0].sin(), sin, atol=2e-4, rtol=0)


def test_llama3_scaling_changes_only_low_frequencies():
    plain = RotaryEmbedding(HEAD_DIM, 1.0, rotary_base=500000.0).inv_freq
    scaled = RotaryEmbedding(HEAD_DIM, 1.0, rotary_base=500000.0, rope_scaling=True).inv_freq
    wavelength = 2 * torch.pi / plain
    torch.testing.assert_close(scaled[wavelength < 2048], plain[wavelength < 2048])
    torch.testing.assert_close(scaled[wavelength > 8192], plain[wavelength > 8192] / 8)
    assert (wavelength > 8192).any() and (wavelength < 2048).any()


def test_interleaved_layout_is_roformer_complex_rotation():
    t = torch.randn(5, 2, 3, HEAD_DIM)
    angles = RotaryEmbedding(HEAD_DIM, 1.0, rotary_interleaved=True)(5)
    rotated = apply_rotary_pos_emb(t, angles, rotary_interleaved=True)
    # Pairs (2i, 2i+1) as complex numbers times e^{i m theta_i}.
    freqs = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    phase = torch.polar(torch.ones(5, HEAD_DIM // 2), torch.outer(torch.arange(5).float(), freqs))
    expected = torch.view_as_real(torch.view_as_complex(t.reshape(5, 2, 3, -1, 2)) * phase[:, None, None])
    torch.testing.assert_close(rotated, expected.reshape(5, 2, 3, HEAD_DIM))


def test_partial_rotary_leaves_the_rest_untouched():
    t = torch.randn(6, 1, 2, HEAD_DIM)
    angles = RotaryEmbedding(HEAD_DIM, 0.5)(6)
    assert angles.size(-1) == HEAD_DIM // 2
    rotated = apply_rotary_pos_emb(t, angles)
    torch.testing.assert_close(rotated[..., HEAD_DIM // 2 :], t[..., HEAD_DIM // 2 :])
    # Rotations preserve the norm of each rotated pair (x_i, x_{i + d'/2}).
    half = HEAD_DIM // 4
    norms = lambda x: x[..., :half] ** 2 + x[..., half : 2 * half] ** 2  # noqa: E731
    torch.testing.assert_close(norms(rotated), norms(t))


def test_odd_rotary_dimension_is_rejected():
    with pytest.raises(ValueError, match="positive even number"):
        RotaryEmbedding(HEAD_DIM, 0.2)  # 3 dimensions
