"""fused_norm_residual: (norm(x), x) whose backward adds the residual's gradient into the norm's own, against
autograd through torch's norm with x used twice. fp32: to 1e-5 of the largest entry (the same sums in another
order); bf16 inputs: to 1e-2 (our dx is rounded once, autograd's twice)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_norm_residual import norm_and_residual


def _case(kind, dtype, device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=generator).to(device=device, dtype=dtype)
    weight = (1 + 0.2 * torch.randn(64, generator=generator)).to(device=device, dtype=dtype)
    bias = (0.2 * torch.randn(64, generator=generator)).to(device=device, dtype=dtype) if kind == "layer" else None
    grad_normed, grad_residual = (torch.randn(5, 3, 64, generator=generator).to(device=device, dtype=dtype)
                                  for _ in range(2))
    return x, weight, bias, grad_normed, grad_residual


def _gradients(fused: bool, kind, x, weight, bias, grad_normed, grad_residual):
    leaves = [t.clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    x, weight = leaves[0] * 1, leaves[1]  # x is a non-leaf, as a layer's input is
    if fused:
        normed, residual = norm_and_residual(x, weight, leaves[2] if kind == "layer" else None, 1e-5)
    else:
        normed = (F.layer_norm(x, weight.shape, weight, leaves[2], 1e-5) if kind == "layer"
                  else F.rms_norm(x, weight.shape, weight, 1e-5))
        residual = x
    torch.autograd.backward([normed, residual], [grad_normed, grad_residual])
    return [normed.detach()] + [leaf.grad for leaf in leaves]


def _check(kind, dtype, device):
    case = _case(kind, dtype, device)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(_gradients(True, kind, *case), _gradients(False, kind, *case)):
        assert got.dtype == want.dtype and got.shape == want.shape
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert error < tolerance, (kind, dtype, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_and_residual_equals_autograd_through_both_uses(kind, dtype):
    _check(kind, dtype, "cpu")


def test_the_residual_output_is_the_input():
    x, weight, bias = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    normed, residual = norm_and_residual(x, weight, bias, 1e-5)
    assert residual.data_ptr() == x.data_ptr() and torch.equal(residual, x)
    torch.testing.assert_close(normed, F.layer_norm(x, (8,), weight, bias, 1e-5))


def test_a_compiled_layer_traces_it_in_one_graph():
    """--use-torch-compile traces the layer whole: dynamo takes the autograd Function into its graph (no break)
    and computes bitwise what eager does (AOT autograd without code generation, on the CPU)."""
    x, weight, bias, grad_normed, grad_residual = _case("layer", torch.bfloat16, "cpu")

    def forward(x, weight, bias):
        return norm_and_residual(x * 1, weight, bias, 1e-5)

    results = []
    for function in (forward, torch.compile(forward, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        outputs = function(*leaves)
        torch.autograd.backward(outputs, [grad_normed, grad_residual])
        results.append([*outputs, *(leaf.grad for leaf in leaves)])
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_and_residual_compiled_on_cuda(kind, dtype):
    _check(kind, dtype, "cuda")
