"""The cached, incremental forward pass computes the same logits as one full forward pass (fp32, max
|difference| < 1e-5; observed ~2e-6), for learned positions and for RoPE + GQA, with the SDPA and the
unfused attention kernels, whatever the chunking of the sequence."""

import pytest
import torch

from megatron.core.inference import StaticInferenceContext
from megatron.core.transformer.attention import causal_mask_over_cache
from megatron.core.transformer.enums import AttnMaskType
from tests.unit_tests.inference.tiny_models import PAIRS, full_forward_logits, random_tokens

ATOL = 1e-5


def _incremental_logits(model, tokens, chunks, last_only=False):
    """Feeds `tokens` [b, s] through the KV cache in chunks of the given lengths; concatenated logits."""
    context = StaticInferenceContext(tokens.size(0), tokens.size(1), materialize_only_last_token_logits=last_only)
    outputs, start = [], 0
    with torch.no_grad():
        for length in chunks:
            end = start + length
            positions = torch.arange(start, end).expand(tokens.size(0), length)
            outputs.append(model(tokens[:, start:end], positions, None, inference_context=context))
            context.increment_sequence_len_offset(length)
            start = end
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("attention_backend", ["auto", "unfused"])
@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 1, 1, 1, 1, 1], [4, 3, 5]])
def test_incremental_logits_equal_full_forward(name, attention_backend, chunks):
    _, model = PAIRS[name](attention_backend)
    tokens = random_tokens(batch=3, length=12)
    expected = full_forward_logits(model, tokens)
    torch.testing.assert_close(_incremental_logits(model, tokens, chunks), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_only_the_last_token_logits_are_materialized(name):
    _, model = PAIRS[name]()
    tokens = random_tokens(batch=2, length=9)
    expected = full_forward_logits(model, tokens)
    logits = _incremental_logits(model, tokens, [6, 3], last_only=True)  # one position per chunk
    assert logits.shape == (2, 2, expected.size(-1))
    torch.testing.assert_close(logits, expected[:, [5, 8]], atol=ATOL, rtol=0)


def test_causal_mask_over_cache_is_bottom_right_aligned():
    # 2 new queries at positions 3 and 4 over 5 cached keys: the first may not see key 4.
    mask, mask_type = causal_mask_over_cache(2, 5, torch.device("cpu"))
    assert mask.tolist() == [[False, False, False, False, True], [False, False, False, False, False]]
    assert mask_type is None
    assert causal_mask_over_cache(1, 5, torch.device("cpu")) == (None, AttnMaskType.no_mask)
    assert causal_mask_over_cache(4, 4, torch.device("cpu")) == (None, None)  # plain causal, built in
