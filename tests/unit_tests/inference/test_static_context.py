"""StaticInferenceContext: the cache returns exactly the keys/values appended so far (against torch.cat of
the appended chunks), per layer, and refuses what does not fit."""

import pytest
import torch

from megatron.core.inference import StaticInferenceContext


def _chunk(length, batch=2, seed=0):
    return torch.randn(length, batch, 2, 8, generator=torch.Generator().manual_seed(seed))  # [s, b, ng, hn]


def test_cache_returns_every_position_so_far():
    context = StaticInferenceContext(max_batch_size=3, max_sequence_length=10)
    keys, values = [], []
    for step, length in enumerate((4, 1, 3)):
        key, value = _chunk(length, seed=2 * step), _chunk(length, seed=2 * step + 1)
        keys.append(key)
        values.append(value)
        cached_key, cached_value = context.append_key_value(1, key, value)
        other_key, _ = context.append_key_value(2, key * 2, value)
        context.increment_sequence_len_offset(length)
        assert torch.equal(cached_key, torch.cat(keys)) and torch.equal(cached_value, torch.cat(values))
        assert torch.equal(other_key, 2 * torch.cat(keys))
    assert context.sequence_len_offset == 8
    assert context.key_value_memory_dict[1][0].shape == (10, 3, 2, 8)


def test_reset_starts_a_new_batch_in_the_same_memory():
    context = StaticInferenceContext(2, 6)
    context.append_key_value(1, _chunk(5), _chunk(5))
    context.increment_sequence_len_offset(5)
    memory = context.key_value_memory_dict[1][0]
    context.reset()
    key = _chunk(3, seed=9)
    cached_key, _ = context.append_key_value(1, key, key)
    assert context.sequence_len_offset == 0 and torch.equal(cached_key, key)
    assert context.key_value_memory_dict[1][0] is memory


def test_overflow_is_refused_with_the_sizes():
    context = StaticInferenceContext(max_batch_size=2, max_sequence_length=4)
    context.append_key_value(1, _chunk(3), _chunk(3))
    context.increment_sequence_len_offset(3)
    with pytest.raises(ValueError, match=r"positions 3..4 do not fit the cache of max_sequence_length 4"):
        context.append_key_value(1, _chunk(2), _chunk(2))
    with pytest.raises(ValueError, match="a batch of 3 sequences does not fit the cache of max_batch_size 2"):
        context.append_key_value(1, _chunk(1, batch=3), _chunk(1, batch=3))


@pytest.mark.parametrize("sizes", [(0, 4), (2, -1), (2.0, 4), (True, 4)])
def test_sizes_must_be_positive_integers(sizes):
    with pytest.raises(ValueError, match="must be a positive integer"):
        StaticInferenceContext(*sizes)
