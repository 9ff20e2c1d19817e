"""vocab_parallel_cross_entropy against F.cross_entropy (and Megatron's label-smoothing formula)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit_tests.dist_utils import run_distributed

S, B, V = 5, 3, 11


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(S, B, V, generator=generator) * 3, torch.randint(0, V, (S, B), generator=generator)


def _smoothed_reference(logits, target, label_smoothing):
    """Megatron/NeMo smoothing: spread a over the V-1 wrong classes, i.e. a' = a V / (V - 1)."""
    log_probs = F.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smoothing = label_smoothing * V / (V - 1)
    return (1 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_tp1_matches_reference_loss_and_grad(label_smoothing):
    logits, target = _inputs()
    ours = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(ours, target, label_smoothing)
    reference_logits = logits.clone().requires_grad_(True)
    if label_smoothing:
        reference = _smoothed_reference(reference_logits, target, label_smoothing)
    else:
        reference = F.cross_entropy(reference_logits.view(-1, V), target.view(-1), reduction="none").view(S, B)
    weights = torch.rand(S, B)  # a non-uniform upstream gradient
    (loss * weights).sum().backward()
    (reference * weights).sum().backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(ours.grad, reference_logits.grad)
    assert torch.equal(ours.detach(), logits)  # the caller's fp32 logits are not modified


def test_bf16_logits_give_fp32_loss():
    logits, target = _inputs()
    loss = vocab_parallel_cross_entropy(logits.bfloat16(), target)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.bfloat16().float().view(-1, V), target.view(-1), reduction="none").view(S, B)
    torch.testing.assert_close(loss, expected)


def _tp2_cross_entropy(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    logits, target = _inputs()
    errors = {}
    for label_smoothing in (0.0, 0.2):
        reference_logits = logits.clone().requires_grad_(True)
        reference = _smoothed_reference(reference_logits, target, label_smoothing)
        reference.sum().backward()
        columns = [range(0, 6), range(6, 11)][rank]  # V = 11 split 6 + 5
        local = logits[..., columns].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing)
        loss.sum().backward()
        errors[label_smoothing] = max(
            (loss - reference).abs().max().item(),
            (local.grad - reference_logits.grad[..., columns]).abs().max().item(),
        )
    return errors


def test_tp2_uneven_vocab_matches_full_cross_entropy():
    for errors in run_distributed(_tp2_cross_entropy, 2):
        assert all(error < 1e-6 for error in errors.values()), errors
