"""CrossAttention against a hand-written multi-head attention, and the decoder layer's cross-attention
sub-layer (reference: Megatron-Core's layout, per head [k_i; v_i] rows in `linear_kv`)."""

import math

import pytest
import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

HEADS, HIDDEN, SQ, SK, BATCH = 4, 32, 5, 7, 3


def _config(**overrides) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                    hidden_dropout=0.0, attention_dropout=0.0)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _cross_attention(config: TransformerConfig) -> CrossAttention:
    torch.manual_seed(0)
    submodules = CrossAttentionSubmodules(
        linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear, core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
    )
    module = CrossAttention(config, submodules, layer_number=1, attn_mask_type=AttnMaskType.padding)
    with torch.no_grad():  # non-zero biases, so that they are checked too
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return module


def reference_cross_attention(state: dict, x: torch.Tensor, context: torch.Tensor, masked_keys=None):
    """softmax(Q K^T / sqrt(hn)) V per head, from the weights by name. x [sq, b, h], context [sk, b, h],
    masked_keys bool [b, sk] (True = hidden)."""
    hn = HIDDEN // HEADS
    q = x @ state["linear_q.weight"].t() + state["linear_q.bias"]  # [sq, b, np*hn]
    kv = context @ state["linear_kv.weight"].t() + state["linear_kv.bias"]  # [sk, b, np*2*hn]
    kv = kv.reshape(SK, BATCH, HEADS, 2, hn)
    k, v = kv[..., 0, :], kv[..., 1, :]  # [sk, b, np, hn]
    q = q.reshape(SQ, BATCH, HEADS, hn)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / math.sqrt(hn)
    if masked_keys is not None:
        scores = scores.masked_fill(masked_keys[:, None, None, :], float("-inf"))
    context_layer = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), v).reshape(SQ, BATCH, HEADS * hn)
    return context_layer @ state["linear_proj.weight"].t() + state["linear_proj.bias"]


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_cross_attention_matches_hand_written_attention(backend):
    module = _cross_attention(_config(attention_backend=backend))
    x, context = torch.randn(SQ, BATCH, HIDDEN), torch.randn(SK, BATCH, HIDDEN)
    masked_keys = torch.zeros(BATCH, SK, dtype=torch.bool)
    masked_keys[1, 4:] = True  # the second sequence's encoder output has 3 padding positions
    output, bias = module(x, attention_mask=masked_keys[:, None, None, :], key_value_states=context)
    state = {name: value.detach() for name, value in module.state_dict().items()}
    expected = reference_cross_attention(state, x, context, masked_keys)
    torch.testing.assert_close(output + bias, expected, atol=1e-5, rtol=1e-5)
    assert sorted(state) == [f"linear_{name}.{kind}" for name in ("kv", "proj", "q") for kind in ("bias", "weight")]
    assert state["linear_kv.weight"].shape == (2 * HIDDEN, HIDDEN)


def test_cross_attention_needs_the_encoder_output_and_one_key_head_per_query_head():
    module = _cross_attention(_config())
    with pytest.raises(ValueError, match="key_value_states"):
        module(torch.randn(SQ, BATCH, HIDDEN), attention_mask=None)
    with pytest.raises(ValueError, match="num_query_groups .2. must equal num_attention_heads .4."):
        _cross_attention(_config(num_query_groups=2))
