"""Core attention (SDPA and unfused backends) against softmax(QK^T/sqrt(d) + mask)V written out here."""

import math

import pytest
import torch

from megatron.core.transformer import dot_product_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

S, B, NP, NG, HN = 7, 2, 4, 2, 8


def _qkv(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(S, B, NP, HN, generator=generator)
    key = torch.randn(S, B, NG, HN, generator=generator)
    value = torch.randn(S, B, NG, HN, generator=generator)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _reference(query, key, value, masked):
    """masked: bool [b, 1, sq, sk], True = not attended. Query head i uses key/value group i // (np/ng)."""
    group_of_head = torch.arange(NP) // (NP // NG)
    q = query.double().permute(1, 2, 0, 3)  # [b, np, s, hn]
    k = key.double()[:, :, group_of_head].permute(1, 2, 0, 3)
    v = value.double()[:, :, group_of_head].permute(1, 2, 0, 3)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HN)
    scores = scores.masked_fill(masked, float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v  # [b, np, s, hn]
    return context.permute(2, 0, 1, 3).reshape(S, B, NP * HN)


def _attention(backend, mask_type=AttnMaskType.causal, **config):
    config = TransformerConfig(
        num_layers=3, hidden_size=NP * HN, num_attention_heads=NP, num_query_groups=NG,
        attention_backend=backend, **{"attention_dropout": 0.0, **config},
    )
    return DotProductAttention(config, layer_number=3, attn_mask_type=mask_type).eval()


CAUSAL = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, 1, S, S)


@pytest.mark.parametrize("backend", ["auto", "unfused", "local"] + ([] if torch.cuda.is_available() else ["flash", "fused"]))
def test_causal_gqa_attention(backend):
    # flash / fused name CUDA kernels; on a CPU they fall back (with a warning) to SDPA's default kernel.
    query, key, value = _qkv()
    output = _attention(backend)(query, key, value, None)
    torch.testing.assert_close(output, _reference(query, key, value, CAUSAL).float())


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_explicit_mask_replaces_the_causal_one(backend):
    query, key, value = _qkv()
    mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(1)) > 0.6
    mask &= ~torch.eye(S, dtype=torch.bool)  # every query attends at least to itself
    for mask_type in (AttnMaskType.causal, AttnMaskType.padding):
        output = _attention(backend, mask_type)(query, key, value, mask)
        torch.testing.assert_close(output, _reference(query, key, value, mask).float())


def test_no_mask_attends_everywhere():
    query, key, value = _qkv()
    output = _attention("auto", AttnMaskType.no_mask)(query, key, value, CAUSAL)
    nothing = torch.zeros(B, 1, S, S, dtype=torch.bool)
    torch.testing.assert_close(output, _reference(query, key, value, nothing).float())


def test_query_key_layer_scaling_is_the_same_function():
    query, key, value = _qkv()
    output = _attention("unfused", apply_query_key_layer_scaling=True)(query, key, value, None)
    torch.testing.assert_close(output, _reference(query, key, value, CAUSAL).float())


def test_bf16_with_fp32_softmax_stays_close_to_fp32():
    query, key, value = _qkv(torch.bfloat16)
    output = _attention("unfused", attention_softmax_in_fp32=True)(query, key, value, None)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), _reference(query, key, value, CAUSAL).float(), atol=2e-2, rtol=2e-2)


def test_dropout_is_applied_in_training_only():
    query, key, value = _qkv()
    attention = _attention("auto", attention_dropout=0.5)
    evaluated = attention(query, key, value, None)
    torch.testing.assert_close(evaluated, _reference(query, key, value, CAUSAL).float())
    attention.train()
    assert not torch.allclose(attention(query, key, value, None), evaluated)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
@pytest.mark.parametrize("window, mask_type", [((2, 0), AttnMaskType.causal), ((1, 2), AttnMaskType.no_mask),
                                               ((-1, 0), AttnMaskType.causal)])
def test_sliding_window(backend, window, mask_type):
    """--window-size (left, right): query i attends keys i - left .. i + right (and no later key when causal)."""
    query, key, value = _qkv()
    i, j = torch.arange(S).unsqueeze(1), torch.arange(S).unsqueeze(0)
    masked = ((j < i - window[0]) if window[0] >= 0 else torch.zeros(S, S, dtype=torch.bool)) | (
        j > i + (0 if mask_type == AttnMaskType.causal else window[1]))
    attention = _attention(backend, mask_type, window_size=window)
    torch.testing.assert_close(attention(query, key, value, None).double(),
                               _reference(query, key, value, masked.expand(B, 1, S, S)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, use_cudnn", [("auto", True), ("fused", True), ("flash", False)])
def test_context_parallel_blocks_follow_the_attention_backend(monkeypatch, backend, use_cudnn):
    """--attention-backend flash keeps context-parallel attention in the flash kernel; the others let its blocks
    take cuDNN's (context_parallel/block_attention.py)."""
    calls = []

    def record(query, key, value, scale, causal, comm_type, **options):
        calls.append(options)
        return torch.zeros(query.size(0), query.size(1), NP * HN)

    monkeypatch.setattr(dot_product_attention, "context_parallel_attention", record)
    _attention(backend, context_parallel_size=2)(*_qkv(), None)
    assert calls[0]["use_cudnn"] is use_cudnn
