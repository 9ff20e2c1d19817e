"""Fused bias-GeLU, bias-SwiGLU and bias-dropout-add against hand-written formulas (CPU: the eager
functions; GPU: the torch.compile kernels, bf16 tolerance, forward and backward)."""

import math

import pytest
import torch

from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl


def needs_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def gelu_tanh_formula(z):
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


def swiglu_formula(z):
    f = z.size(-1) // 2
    gate, up = z[..., :f], z[..., f:]
    return gate * torch.sigmoid(gate) * up


def _compare(fused, formula, shape, device, dtype, with_bias, atol, rtol):
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    bias = torch.randn(shape[-1], device=device, dtype=dtype, generator=generator) if with_bias else None
    grad = torch.randn(fused(x, bias).shape, device=device, dtype=dtype, generator=generator)
    inputs = [x] + ([bias] if with_bias else [])
    ours = [t.clone().requires_grad_(True) for t in inputs]
    out = fused(ours[0], ours[1] if with_bias else None)
    out.backward(grad)
    reference = [t.detach().double().requires_grad_(True) for t in inputs]
    z = reference[0] + reference[1] if with_bias else reference[0]
    expected = formula(z)
    expected.backward(grad.double())
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, atol=atol * 4, rtol=rtol * 4)


@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_and_swiglu_on_cpu(with_bias):
    _compare(bias_gelu_impl, gelu_tanh_formula, (5, 3, 16), "cpu", torch.float32, with_bias, 1e-5, 1e-5)
    _compare(bias_swiglu_impl, swiglu_formula, (5, 3, 16), "cpu", torch.float32, with_bias, 1e-5, 1e-5)


@needs_gpu
@pytest.mark.parametrize("shape", [(7, 3, 64), (128, 4, 1024), (33, 2, 3000)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused, formula", [(bias_gelu_impl, gelu_tanh_formula), (bias_swiglu_impl, swiglu_formula)])
def test_compiled_kernels_on_gpu(fused, formula, dtype, with_bias, shape):
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    _compare(fused, formula, shape, "cuda", dtype, with_bias, tolerance, tolerance)


def test_bias_dropout_add_on_cpu_equals_residual_plus_dropout_with_the_same_mask():
    x, bias, residual = torch.randn(6, 2, 8), torch.randn(8), torch.randn(6, 2, 8)
    torch.testing.assert_close(bias_dropout_add_fused((x, bias), residual, 0.3, False), residual + x + bias)
    torch.manual_seed(3)
    out = bias_dropout_add_fused((x, bias), residual, 0.3, True)
    torch.manual_seed(3)
    torch.testing.assert_close(out, residual + torch.nn.functional.dropout(x + bias, p=0.3))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bias_dropout_add_compiled_on_gpu(dtype):
    generator = torch.Generator("cuda").manual_seed(0)
    x, residual = (torch.randn(256, 4, 512, device="cuda", dtype=dtype, generator=generator) for _ in range(2))
    bias = torch.randn(512, device="cuda", dtype=dtype, generator=generator)
    expected = (residual.float() + x.float() + bias.float())
    torch.testing.assert_close(bias_dropout_add_fused((x, bias), residual, 0.1, False).float(), expected,
                               atol=2e-2, rtol=2e-2)
    # With dropout: every entry is either the residual (dropped) or residual + (x + b) / (1 - p).
    p = 0.25
    out = bias_dropout_add_fused((x.float(), bias.float()), residual.float(), p, True)
    dropped = torch.isclose(out, residual.float(), atol=1e-6)
    kept = torch.isclose(out, residual.float() + (x.float() + bias.float()) / (1 - p), atol=1e-4, rtol=1e-4)
    assert bool((dropped | kept).all())
    assert abs(dropped.float().mean().item() - p) < 0.01
