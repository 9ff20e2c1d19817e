"""YarnRotaryEmbedding against Hugging Face's YaRN (`_compute_yarn_parameters`): the blended frequencies and the
concentration factor, with and without rounding of the correction range, for DeepSeek-V3's and other
settings; and the softmax scale of multi-latent attention against DeepseekV3Attention's."""

import math

import pytest
import torch

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.transformer.multi_latent_attention import mla_softmax_scale
from megatron.core.transformer.transformer_config import MLATransformerConfig

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("factor, mscale, mscale_all_dim, original, beta_fast, beta_slow, truncate", [
    (40.0, 1.0, 1.0, 4096, 32.0, 1.0, True),  # DeepSeek-V3
    (4.0, 0.9, 0.0, 64, 16.0, 2.0, False),
    (8.0, 1.0, 0.707, 2048, 32.0, 1.0, True),
])
def test_frequencies_and_concentration_match_transformers(factor, mscale, mscale_all_dim, original, beta_fast,
                                                          beta_slow, truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim, base = 64, 10000.0
    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=dim, rope_theta=base, max_position_embeddings=original * int(factor),
        rope_scaling={"rope_type": "yarn", "factor": factor, "mscale": mscale, "mscale_all_dim": mscale_all_dim,
                      "original_max_position_embeddings": original, "beta_fast": beta_fast,
                      "beta_slow": beta_slow, "truncate": truncate},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = YarnRotaryEmbedding(
        dim, rotary_base=base, use_cpu_initialization=True, scaling_factor=factor,
        original_max_position_embeddings=original, beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale,
        mscale_all_dim=mscale_all_dim, correction_range_round_to_int=truncate,
    )
    torch.testing.assert_close(ours.inv_freq, inv_freq, rtol=1e-6, atol=0)
    angles, concentration = ours(5, offset=3)
    # With mscale_all_dim 0 Megatron-Core takes mscale(s, mscale) / mscale(s, 0) = mscale(s, mscale) where HF falls
    # back to mscale(s, 1); the export then writes Megatron's factor as rope_scaling["attention_factor"].
    expected = attention_factor if mscale_all_dim else 0.1 * mscale * math.log(factor) + 1
    assert concentration == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(angles[:, 0, 0, : dim // 2], torch.outer(torch.arange(3, 8.0), inv_freq))

    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, layer_idx=0)
    mla = MLATransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, qk_head_dim=128,
                               qk_pos_emb_head_dim=dim, rotary_scaling_factor=factor, mscale_all_dim=mscale_all_dim)
    assert mla_softmax_scale(mla) == pytest.approx(attention.scaling, rel=1e-12)
    assert mla_softmax_scale(MLATransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)) == (
        1 / math.sqrt(128 + 64))
