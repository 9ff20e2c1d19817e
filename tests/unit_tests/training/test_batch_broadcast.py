"""Microbatches read on TP rank 0 reach every rank of its TP group unchanged (`get_batch_on_this_tp_rank`):
several batches, a short last one, a missing key, a non-contiguous tensor, an exhausted iterator (every rank
stops) and a batch that cannot be sent (every rank fails)."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.training.batch_broadcast import GPT_BATCH_KEYS, broadcast_batch, get_batch_on_this_tp_rank
from tests.unit_tests.dist_utils import run_distributed


def _gpt_batch(seed: int, batch: int = 2, seq: int = 8) -> dict:
    """A GPT microbatch as the data loader collates GPTDataset samples, drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (batch, seq + 1), generator=generator)
    return {
        "tokens": tokens[:, :-1].clone(),
        "labels": tokens[:, 1:].clone(),
        "loss_mask": (torch.rand(batch, seq, generator=generator) > 0.2).float(),
        "attention_mask": torch.rand(batch, 1, seq, seq, generator=generator) > 0.5,
        "position_ids": torch.arange(seq).expand(batch, seq),  # a view, as a dataset may hand it over
    }


def _same(received: dict, expected: dict, keys) -> bool:
    return all(
        (received[key] is None and expected.get(key) is None)
        or (received[key].dtype == expected[key].dtype and torch.equal(received[key], expected[key]))
        for key in keys
    )


def _broadcasts(rank, world_size):
    """4 ranks, TP=2: groups [0, 1] and [2, 3] each receive their own TP rank 0's batches."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    source = parallel_state.get_tensor_model_parallel_src_rank()
    expected = [_gpt_batch(100 * source + index) for index in range(2)]
    expected.append(_gpt_batch(100 * source + 2, batch=1, seq=5))  # a short last batch: other shapes
    del expected[1]["attention_mask"]  # a key the dataset did not produce
    is_source = parallel_state.get_tensor_model_parallel_rank() == 0
    iterator = iter([dict(batch) for batch in expected]) if is_source else None

    results = {}
    received = [get_batch_on_this_tp_rank(iterator, tp_group=tp_group) for _ in expected]
    results["batches"] = all(_same(got, want, GPT_BATCH_KEYS) for got, want in zip(received, expected))
    results["keys"] = [sorted(batch) for batch in received]
    try:
        get_batch_on_this_tp_rank(iterator, tp_group=tp_group)
        results["exhausted"] = "no StopIteration"
    except StopIteration:
        results["exhausted"] = "StopIteration"

    # Only the requested keys travel (get_batch leaves out the causal mask).
    without_mask = get_batch_on_this_tp_rank(iter([_gpt_batch(7)]) if is_source else None, GPT_BATCH_KEYS[:3],
                                             tp_group=tp_group)
    results["subset"] = sorted(without_mask) == sorted(GPT_BATCH_KEYS[:3]) and _same(
        without_mask, _gpt_batch(7), GPT_BATCH_KEYS[:3]
    )

    # A batch that cannot be sent fails on every rank of the group instead of leaving the others waiting.
    bad = {"tokens": [1, 2, 3]}
    try:
        broadcast_batch(bad if is_source else None, ("tokens",), tp_group=tp_group)
        results["refused"] = "accepted"
    except ValueError as error:
        results["refused"] = str(error)
    return results


def test_each_tp_group_receives_its_source_batches_and_stops_together():
    for rank, results in enumerate(run_distributed(_broadcasts, 4)):
        assert results["batches"], f"rank {rank} received different tensors"
        assert results["keys"] == [sorted(GPT_BATCH_KEYS)] * 3
        assert results["exhausted"] == "StopIteration"
        assert results["subset"]
        if rank % 2 == 0:
            assert "batch['tokens'] cannot be broadcast over the tensor-parallel group" in results["refused"]
            assert "got list" in results["refused"]
        else:
            assert "tensor-parallel rank 0 could not broadcast its batch" in results["refused"]


def test_single_rank_moves_the_batch_without_collectives():
    batch = _gpt_batch(3)
    received = get_batch_on_this_tp_rank(iter([batch]), tp_group=None)
    assert _same(received, batch, GPT_BATCH_KEYS)
    with pytest.raises(StopIteration):
        get_batch_on_this_tp_rank(iter([]), tp_group=None)
    with pytest.raises(ValueError, match="at most 4 dims"):
        broadcast_batch({"tokens": torch.zeros(1, 1, 1, 1, 1, dtype=torch.int64)}, ("tokens",), tp_group=None)
