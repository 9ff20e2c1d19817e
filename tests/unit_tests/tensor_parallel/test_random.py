"""The RNG-stream tracker and activation checkpointing that replays dropout exactly."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker


def test_fork_uses_its_own_stream_and_leaves_the_default_one_alone():
    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 123)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(4)
    outside = torch.rand(4)
    with tracker.fork("stream"):
        second = torch.rand(4)

    torch.manual_seed(123)
    expected_stream = torch.rand(8)
    torch.manual_seed(0)
    expected_outside = torch.rand(4)
    torch.testing.assert_close(torch.cat([first, second]), expected_stream)  # the stream continues
    torch.testing.assert_close(outside, expected_outside)  # the default generator never moved


def test_tracker_rejects_reuse_and_unknown_streams():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(RuntimeError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("missing"):
            pass


def test_model_parallel_seed_offsets():
    model_parallel_cuda_manual_seed(10)
    states = get_cuda_rng_tracker().get_states()
    assert set(states) == {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    with get_cuda_rng_tracker().fork():
        drawn = torch.rand(3)
    torch.manual_seed(10 + 2718)  # seed + 2718 + tp_rank (0 here)
    torch.testing.assert_close(drawn, torch.rand(3))


def _dropout_block(x, weight):
    hidden = F.dropout(torch.tanh(x @ weight), p=0.5)  # default generator
    with get_cuda_rng_tracker().fork():
        hidden = F.dropout(hidden, p=0.5)  # tracked stream
    return hidden @ weight


def test_checkpoint_replays_both_generators_in_recomputation():
    weight = torch.randn(6, 6)
    x = torch.randn(4, 6)
    grads = []
    for use_checkpoint in (False, True):
        model_parallel_cuda_manual_seed(7)
        w, inp = weight.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out = checkpoint(_dropout_block, False, inp, w) if use_checkpoint else _dropout_block(inp, w)
        out.sum().backward()
        grads.append((out.detach(), w.grad, inp.grad))
    for without, with_recompute in zip(*grads):
        torch.testing.assert_close(with_recompute, without, rtol=0, atol=0)


def test_distribute_saved_activations_is_not_supported_yet():
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        checkpoint(_dropout_block, True, torch.randn(2, 6), torch.randn(6, 6))
