"""Gradient norm, clipping and zero counting against torch.nn.utils.clip_grad_norm_ and full tensors."""

import math

import pytest
import torch

from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)


def params_with_grads(seed=0, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in [(7, 5), (5,), (3, 2, 4)]]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * scale
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_matches_torch_clip_grad_norm(max_norm):
    ours, reference = params_with_grads(), params_with_grads()
    norm = get_grad_norm_fp32([param.grad for param in ours])
    clip_grad_by_total_norm_fp32(ours, max_norm, norm)
    reference_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    assert norm == pytest.approx(reference_norm.item(), rel=1e-6)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7)


def test_infinity_norm():
    params = params_with_grads()
    expected = max(param.grad.abs().max().item() for param in params)
    assert get_grad_norm_fp32([param.grad for param in params], norm_type=math.inf) == expected


def test_count_zeros_skips_shared_copies():
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    params[0].grad = torch.tensor([0.0, 1.0, 0.0, 2.0])
    params[1].grad = torch.tensor([3.0, 0.0, 5.0, 6.0])
    params[2].grad = torch.zeros(4)
    params[2].shared = True  # the tied output-layer copy of the embedding: counted on its first stage
    assert count_zeros_fp32(params) == 3
