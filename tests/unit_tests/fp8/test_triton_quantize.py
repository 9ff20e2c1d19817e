"""The Triton quantization kernel (megatron/core/fp8/triton_quantize.py) against quantize.py's functions, and
the once-per-step weight quantization of the scaling state (megatron/core/fp8/scaling.py).

The kernel tests run in Triton's interpreter on the CPU: `test_kernel_in_the_triton_interpreter` runs this
file again in a subprocess with TRITON_INTERPRET=1 (read when Triton is imported), where the tests marked
`in_interpreter` run and every FP8 quantization of the scaling state goes through the kernel. Every result
must equal the reference bit for bit: q, the zero-padded q^T, the amax folded into a running amax (NaN and
inf included) and 1 / scale; fp8_linear's outputs, gradients and scaling state over two steps of two
microbatches. The weight tests run in both processes (eager functions here, the kernel there).
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.fp8 import fp8_linear, update_fp8_scaling
from megatron.core.fp8.quantize import quantize_transposed, quantize_with_amax_and_transpose, saturating_cast
from megatron.core.fp8.scaling import INPUT, WEIGHT, Fp8Scaling, load_fp8_extra_state
from megatron.core.fp8 import triton_quantize
from megatron.core.fp8.triton_quantize import quantize_fused
from tests.unit_tests.fp8.test_fp8_linear import _inputs, _scaling, check_against_reference

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
in_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in test_kernel_in_the_triton_interpreter")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.skipif(INTERPRETING or not HAS_TRITON, reason="needs Triton; starts the interpreter run")
def test_kernel_in_the_triton_interpreter():
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
               "not test_kernel_in_the_triton_interpreter"]
    done = subprocess.run(command,
                          env=dict(os.environ, TRITON_INTERPRET="1"), cwd=REPOSITORY, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _run_kernel(x, scale, dtype, running_amax=0.0, **options):
    """(q, q^T, running amax after the fold, scale_inv) from `quantize_fused`."""
    scale, scale_inv, amax = torch.tensor(scale), torch.empty(()), torch.tensor(running_amax)
    q, qt = quantize_fused(x, scale, scale_inv, dtype, amax=amax, **options)
    return q, qt, amax, scale_inv


@in_interpreter
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_of_every_bf16_value_equals_saturating_cast(dtype):
    """All 65536 bf16 bit patterns (zeros, subnormals, normals, inf, NaN of both signs) at scales that put
    them below, across and beyond the FP8 range."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    for scale in (1.0, 7.3, 2.0**-20, 2.0**40, 3.0e38):
        q, qt, amax, scale_inv = _run_kernel(x, scale, dtype, transpose_padding=16)
        expected = saturating_cast(x, torch.tensor(scale), dtype)
        assert torch.equal(_bits(q), _bits(expected)), scale
        assert torch.equal(_bits(qt), _bits(expected.t().contiguous())), scale
        assert amax.isnan()
        assert torch.equal(scale_inv, torch.tensor(scale).reciprocal())


@in_interpreter
@pytest.mark.parametrize("rows, columns", [(1, 16), (15, 48), (37, 50), (130, 260)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_outputs_equal_the_reference_functions(rows, columns, dtype):
    """Odd sizes and several tiles with tails: q, q^T padded to 16 rows, the amax folded into a running
    amax below and above it, q alone, and the weight's unpadded q^T alone."""
    x = (40 * torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows))).bfloat16()
    scale = torch.tensor(3.0)
    data, transposed, scale_inv, amax = quantize_with_amax_and_transpose(x, scale, dtype)
    for running in (0.5, 1e4):
        q, qt, folded, ours_inv = _run_kernel(x, 3.0, dtype, running, transpose_padding=16)
        assert torch.equal(_bits(q), _bits(data)) and torch.equal(_bits(qt), _bits(transposed))
        assert qt.shape == (columns, rows + (-rows % 16))
        assert folded == max(running, amax.item()) and torch.equal(ours_inv, scale_inv)
    q, qt, untouched, _ = _run_kernel(x, 3.0, dtype, 0.5)
    assert torch.equal(_bits(q), _bits(data)) and qt is None
    q, qt, _, _ = _run_kernel(x, 3.0, dtype, data=False, transpose_padding=1)
    assert q is None and torch.equal(_bits(qt), _bits(quantize_transposed(x, scale, dtype)))


@in_interpreter
@pytest.mark.parametrize("input_dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_inputs(input_dtype):
    x = (100 * torch.randn(20, 64, generator=torch.Generator().manual_seed(1))).to(input_dtype)
    x[0, :4] = torch.tensor([1e-30, -1e-30, 70000.0, -float("inf")]).to(input_dtype)
    data, transposed, _, amax = quantize_with_amax_and_transpose(x, torch.tensor(5.0), E4M3)
    q, qt, folded, _ = _run_kernel(x, 5.0, E4M3, transpose_padding=16)
    assert torch.equal(_bits(q), _bits(data)) and torch.equal(_bits(qt), _bits(transposed))
    assert folded == amax


@in_interpreter
def test_inf_and_nan_stay_visible_in_the_amax():
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3, 5] = -float("inf")
    q, _, amax, _ = _run_kernel(x, 2.0, E4M3)
    assert amax == float("inf") and q[3, 5].float() == -448.0
    x[7, 1] = float("nan")
    q, qt, amax, _ = _run_kernel(x, 2.0, E5M2, transpose_padding=16)
    expected = saturating_cast(x, torch.tensor(2.0), E5M2)
    assert amax.isnan() and torch.equal(_bits(q), _bits(expected)) and q[7, 1].float().isnan()
    # A NaN already in the running amax stays there after a finite x.
    _, _, amax, _ = _run_kernel(torch.ones(4, 16, dtype=torch.bfloat16), 1.0, E4M3, float("nan"))
    assert amax.isnan()


def _two_steps(fp8_format, wgrad, enabled, monkeypatch):
    """Y and dX of every microbatch, then main_grad, the bias gradient and the scaling state, after two steps
    of two microbatches; the weight changes between the steps as an optimizer changes it."""
    monkeypatch.setattr(triton_quantize, "ENABLED", enabled)
    x, w, b, dy = _inputs((3, 5), 32, 48)
    scaling = _scaling(fp8_format, "delayed", wgrad)
    weight, bias = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(w.shape), False
    results = []
    for _ in range(2):
        for microbatch in range(2):
            inputs = (x * (microbatch + 1)).requires_grad_()
            output = fp8_linear(inputs, weight, bias, scaling, True)
            output.backward(dy)
            results += [output, inputs.grad]
        update_fp8_scaling([scaling])
        weight.data.mul_(1.5)  # as a fused optimizer writes it: no version bump
    return results + [weight.main_grad, bias.grad, scaling.meta]


@in_interpreter
@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_fp8_linear_through_the_kernel_equals_the_reference_path(fp8_format, wgrad, monkeypatch):
    through_kernel = _two_steps(fp8_format, wgrad, True, monkeypatch)
    reference = _two_steps(fp8_format, wgrad, False, monkeypatch)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(through_kernel, reference))
    check_against_reference((3, 5), 32, 48, fp8_format, "delayed", wgrad, fusion=True)


def _counting_weight_quantizations(monkeypatch) -> list:
    calls = []
    quantize_weight = Fp8Scaling._quantize_weight

    def counted(self, weight, record, transpose):
        calls.append((record, transpose))
        return quantize_weight(self, weight, record, transpose)

    monkeypatch.setattr(Fp8Scaling, "_quantize_weight", counted)
    return calls


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_weight_is_quantized_once_per_step(recipe, monkeypatch):
    """Three microbatches per step quantize the weight once (q_W and q_W^T together); the step-end update
    frees both before the optimizer step."""
    calls = _counting_weight_quantizations(monkeypatch)
    x, w, _, dy = _inputs((2, 8), 32, 16)
    scaling, weight = _scaling("hybrid", recipe, True), torch.nn.Parameter(w.clone())
    for step in range(2):
        gradients = []
        for _ in range(3):
            inputs = x.clone().requires_grad_()
            fp8_linear(inputs, weight, None, scaling).backward(dy)
            gradients.append(inputs.grad)
        assert calls == [(True, True)] * (step + 1)
        assert all(torch.equal(gradient, gradients[0]) for gradient in gradients)
        update_fp8_scaling([scaling])
        assert scaling._weight is None


def _fresh_output(x, weight, scaling):
    """fp8_linear with a new scaling state holding `scaling`'s scales: what a quantization now gives."""
    fresh = _scaling(scaling.recipe.format, scaling.recipe.recipe, True)
    fresh.meta.copy_(scaling.meta)
    return fp8_linear(x, weight.detach().clone(), None, fresh)


def test_a_changed_weight_is_quantized_again():
    x, w, _, _ = _inputs((2, 8), 32, 16)
    scaling, weight = _scaling("e4m3", "delayed", True), torch.nn.Parameter(w.clone())
    fp8_linear(x, weight, None, scaling)
    with torch.no_grad():  # in place, seen by autograd's version counter
        weight.mul_(2.0)
    assert torch.equal(fp8_linear(x, weight, None, scaling), _fresh_output(x, weight, scaling))
    weight.data.mul_(0.25)  # unseen by autograd, as a fused optimizer's write: the step-end update drops it
    update_fp8_scaling([scaling])
    assert torch.equal(fp8_linear(x, weight, None, scaling), _fresh_output(x, weight, scaling))
    other = torch.nn.Parameter(3 * w)  # another tensor
    assert torch.equal(fp8_linear(x, other, None, scaling), _fresh_output(x, other, scaling))


def test_evaluation_before_training_still_records_the_weight_amax(monkeypatch):
    calls = _counting_weight_quantizations(monkeypatch)
    x, w, _, _ = _inputs((2, 8), 32, 16)
    scaling, weight = _scaling("hybrid", "delayed", True), torch.nn.Parameter(w.clone())
    with torch.no_grad():
        fp8_linear(x, weight, None, scaling.eval())
    assert scaling.meta[1, WEIGHT] == 0 and calls == [(False, False)]
    fp8_linear(x.requires_grad_(), weight, None, scaling.train())
    assert scaling.meta[1, WEIGHT] == w.abs().max() and calls == [(False, False), (True, True)]
    assert scaling.meta[1, INPUT] == x.abs().max()


def test_loading_a_checkpoint_drops_the_quantized_weight():
    layer = torch.nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)
    layer.fp8 = _scaling("hybrid", "delayed", True)
    layer.register_load_state_dict_pre_hook(load_fp8_extra_state)
    fp8_linear(torch.randn(4, 32, dtype=torch.bfloat16), layer.weight, None, layer.fp8)
    assert layer.fp8._weight is not None
    layer.load_state_dict({"weight": torch.zeros(16, 32)})
    assert layer.fp8._weight is None
