"""fp8_linear against the FP8 linear written out by hand, and against the bf16 linear.

Reference: quantize X, W and dY with the same scales (saturate(x * scale) cast to E4M3/E5M2, then back
to fp32 and times 1/scale), then plain fp32 matmuls: Y = X_q W_q^T + b, dX = dY_q W_q, dW = dY_q^T X_q.
Tolerances: the bf16 outputs (Y, dX, a bf16 dW) within one bf16 rounding of the reference (rtol 2^-7);
fp32 dW (accumulated in main_grad) within 1e-5 relative (only the summation order differs). Against the
unquantized bf16 linear the relative error norm stays under 6% (E4M3's 3 mantissa bits: 2^-4 per element)
for Y and under 12% with E5M2 gradients (2 mantissa bits).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fp8 import Fp8Recipe, Fp8Scaling, fp8_linear
from megatron.core.fp8.quantize import FP8_MAX, saturating_cast
from megatron.core.fp8.scaling import GRAD_OUTPUT, INPUT, WEIGHT

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Scales of (X, W, dY) for the delayed recipe: X ~ N(0, 1), W ~ N(0, 0.05^2), dY ~ N(0, 1e-3^2).
DELAYED_SCALES = (60.0, 2000.0, 1.0e5)


def _dequantized(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8_max = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype).float() / scale


def _current_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return FP8_MAX[dtype] / x.float().abs().max()


def _inputs(shape, in_features, out_features, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, in_features, generator=generator)
    w = 0.05 * torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator)
    dy = 1e-3 * torch.randn(*shape, out_features, generator=generator)
    return [t.to(device=device, dtype=torch.bfloat16) for t in (x, w, b, dy)]


def _scaling(fp8_format, recipe, wgrad, device="cpu") -> Fp8Scaling:
    scaling = Fp8Scaling(Fp8Recipe(fp8_format, recipe, wgrad=wgrad), torch.device(device))
    if recipe == "delayed":
        scaling.meta[0] = torch.tensor(DELAYED_SCALES)
    return scaling


def _reference(x, w, b, dy, scaling: Fp8Scaling):
    """(Y, dX, dW, db) in fp32 from the operands quantized with the scales `scaling` uses."""
    grad_dtype = E5M2 if scaling.recipe.format == "hybrid" else E4M3
    if scaling.recipe.recipe == "delayed":
        scales = [torch.tensor(s, device=x.device) for s in DELAYED_SCALES]
    else:
        scales = [_current_scale(x, E4M3), _current_scale(w, E4M3), _current_scale(dy, grad_dtype)]
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    xq, wq = _dequantized(x2, scales[0], E4M3), _dequantized(w, scales[1], E4M3)
    dyq = _dequantized(dy2, scales[2], grad_dtype)
    y = xq @ wq.t() + b.float()
    dx = dyq @ wq
    dw = dyq.t() @ xq if scaling.recipe.wgrad else dy2.float().t() @ x2.float()
    return y.view(*x.shape[:-1], -1), dx.view(x.shape), dw, dy2.float().sum(0)


def _run(x, w, b, dy, scaling, gradient_accumulation_fusion=False):
    x = x.clone().requires_grad_()
    w, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    if gradient_accumulation_fusion:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        w.grad_added_to_main_grad = False
    y = fp8_linear(x, w, b, scaling, gradient_accumulation_fusion)
    y.backward(dy)
    dw = w.main_grad if gradient_accumulation_fusion else w.grad
    return y, x.grad, dw, b.grad


CASES = [(fmt, recipe, wgrad) for fmt in ("e4m3", "hybrid") for recipe in ("delayed", "tensorwise")
         for wgrad in (True, False)]


def check_against_reference(shape, in_features, out_features, fp8_format, recipe, wgrad, device="cpu",
                            fusion=False, rtol=2**-7, forward_rtol=2**-7, fp32_rtol=1e-5):
    """fp8_linear on `device` against `_reference` computed there in fp32; `rtol` for bf16 results, relative
    to each entry and to the largest entry; `forward_rtol` for Y; `fp32_rtol` for a dW in main_grad."""
    x, w, b, dy = _inputs(shape, in_features, out_features, device=device)
    scaling = _scaling(fp8_format, recipe, wgrad, device)
    y, dx, dw, db = _run(x, w, b, dy, scaling, fusion)
    expected = _reference(x, w, b, dy, scaling)
    for name, actual, reference in zip(("Y", "dX", "dW", "db"), (y, dx, dw, db), expected):
        assert actual.shape == reference.shape, name
        tolerance = fp32_rtol if actual.dtype == torch.float32 else forward_rtol if name == "Y" else rtol
        torch.testing.assert_close(actual.float(), reference, rtol=tolerance,
                                   atol=tolerance * reference.abs().max().item(), msg=lambda found: f"{name}: {found}")


@pytest.mark.parametrize("fp8_format, recipe, wgrad", CASES)
def test_equals_the_reference_written_out(fp8_format, recipe, wgrad):
    # 3 x 5 = 15 tokens: the dW GEMM pads the token dimension to 16.
    check_against_reference((3, 5), 32, 48, fp8_format, recipe, wgrad)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_weight_gradient_in_main_grad_equals_the_reference(recipe):
    check_against_reference((4, 8), 64, 32, "hybrid", recipe, True, fusion=True)
    check_against_reference((4, 8), 64, 32, "hybrid", recipe, False, fusion=True)


def test_main_grad_is_written_by_the_first_microbatch_and_added_to_by_the_next():
    """DDP zeroes main_grad and clears grad_added_to_main_grad at each step; the first dW overwrites it."""
    x, w, b, dy = _inputs((2, 8), 32, 16)
    scaling = _scaling("hybrid", "delayed", True)
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.full(w.shape, float("nan"))  # not read: the flag says nothing was written yet
    weight.grad_added_to_main_grad = False
    for microbatch in range(2):
        fp8_linear(x.flip(0) if microbatch else x, weight, None, scaling, True).backward(dy)
    _, _, dw_first, _ = _reference(x, w, b, dy, scaling)
    _, _, dw_second, _ = _reference(x.flip(0), w, b, dy, scaling)
    torch.testing.assert_close(weight.main_grad, dw_first + dw_second, rtol=1e-5, atol=1e-8)
    assert weight.grad_added_to_main_grad


def test_microbatches_in_flight_as_a_pipeline_schedule_runs_them():
    """forward 1, forward 2, backward 1, backward 2: the amaxes the second forward records do not disturb
    the first backward, and both use the step's scales."""
    x, w, b, dy = _inputs((2, 8), 32, 16)
    together, one_by_one = _scaling("hybrid", "delayed", True), _scaling("hybrid", "delayed", True)
    weight = torch.nn.Parameter(w.clone())
    inputs = [x.clone().requires_grad_(), x.flip(0).clone().requires_grad_()]
    outputs = [fp8_linear(inputs[0], weight, b, together), fp8_linear(inputs[1], weight, b, together)]
    for output in outputs:
        output.backward(dy)
    expected = [_run(microbatch, w, b, dy, one_by_one)[1] for microbatch in (x, x.flip(0))]  # dX one by one
    assert all(torch.equal(given.grad, wanted) for given, wanted in zip(inputs, expected))
    assert torch.equal(together.meta, one_by_one.meta)


def test_only_the_gradients_asked_for():
    x, w, b, dy = _inputs((2, 8), 32, 16)
    scaling = _scaling("e4m3", "delayed", True)
    _, expected_dx, expected_dw, _ = _reference(x, w, b, dy, scaling)
    frozen_weight, frozen_input = (x.clone().requires_grad_(), w), (x, torch.nn.Parameter(w.clone()))
    for inputs, expected in ((frozen_weight, expected_dx), (frozen_input, expected_dw)):
        fp8_linear(*inputs, None, scaling).backward(dy)
        grads = [tensor.grad for tensor in inputs]
        assert sum(grad is None for grad in grads) == 1
        actual = next(grad for grad in grads if grad is not None).float()
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())


@pytest.mark.parametrize("fp8_format, gradient_bound", [("e4m3", 0.06), ("hybrid", 0.12)])
def test_close_to_the_bf16_linear(fp8_format, gradient_bound):
    x, w, b, dy = _inputs((4, 16), 128, 96, seed=3)
    y, dx, dw, _ = _run(x, w, b, dy, _scaling(fp8_format, "tensorwise", True))
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b)
    y_ref.backward(dy)

    def relative_error(actual, expected):
        return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()

    assert relative_error(y, y_ref) < 0.06
    assert relative_error(dx, x_ref.grad) < gradient_bound
    assert relative_error(dw, w_ref.grad) < gradient_bound


@pytest.mark.parametrize("fp8_format, grad_dtype", [("e4m3", E4M3), ("hybrid", E5M2)])
def test_format_picks_the_gradient_dtype(fp8_format, grad_dtype):
    scaling = _scaling(fp8_format, "delayed", True)
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    assert scaling.quantize(x, INPUT, False).data.dtype == E4M3
    assert scaling.quantize(x, WEIGHT, False).data.dtype == E4M3
    assert scaling.quantize(x, GRAD_OUTPUT, False).data.dtype == grad_dtype


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_values_beyond_the_largest_fp8_saturate(dtype):
    fp8_max = FP8_MAX[dtype]
    x = torch.tensor([2 * fp8_max, -1e30, fp8_max, 0.5, float("nan")])
    cast = saturating_cast(x, torch.tensor(1.0), dtype).float()
    assert cast[:4].tolist() == [fp8_max, -fp8_max, fp8_max, 0.5]
    assert cast[4].isnan()
    # Through the linear: an input 4x beyond the E4M3 range at scale 1 acts as 448.
    scaling = Fp8Scaling(Fp8Recipe("e4m3", "delayed"), torch.device("cpu"))
    y = fp8_linear(torch.full((16, 16), 4 * 448.0, dtype=torch.bfloat16), torch.eye(16, dtype=torch.bfloat16),
                   None, scaling)
    assert torch.equal(y, torch.full((16, 16), 448.0, dtype=torch.bfloat16))
