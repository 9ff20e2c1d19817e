"""fp8_linear on a GPU (compute capability 8.9+: the cuBLAS FP8 GEMMs of torch._scaled_mm, the quantizations
compiled by Inductor) against the same hand-written reference as on the CPU (test_fp8_linear.py), computed on
the GPU in fp32, for shapes of the Llama-style 3.6B model (h 3072, 24 heads, 8 key/value groups, ffn 8192)
and an odd token count (the dW GEMM pads it).

Tolerances: dX and a bf16 dW within one bf16 rounding (rtol 2^-7, relative to each entry and to the largest);
Y within 3e-2, as its GEMM accumulates in cuBLAS' fast mode (Transformer Engine's and torchao's choice for the
forward; its partial sums keep fewer bits); a dW accumulated in fp32 main_grad within the same 2^-7: on an
H100 (2026-11-26) it missed 1e-4 at the 4096-token shapes while the same GEMM's bf16 dW passed 2^-7, as
Hopper's FP8 tensor cores keep ~14-bit partial sums even where cuBLAS promotes them to fp32 in intervals
(DeepSeek-V3 report, section 3.3.2), so fp32 main_grad is checked for where dW goes, not for more precision
than the FP8 GEMM has.
The compiled quantizations equal the eager functions bitwise (1 ulp for the reciprocal scale), and so does
the Triton kernel that the scaling state uses on the GPU (triton_quantize.py), its 1 / scale included, for
every bf16 value (NaN, inf, subnormals) and at the model's shapes.
"""

import pytest
import torch

from megatron.core.fp8.quantize import (
    quantize_current,
    quantize_current_and_transpose,
    quantize_transposed,
    quantize_with_amax,
    quantize_with_amax_and_transpose,
)
from megatron.core.fp8.triton_quantize import TRITON_AVAILABLE, quantize_fused
from tests.unit_tests.fp8.test_fp8_linear import CASES, check_against_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU of compute capability 8.9+"),
]

# (token dims, in_features K, out_features N)
SHAPES = {
    "odd tokens": ((3, 5), 32, 48),
    "qkv": ((2, 2048), 3072, 5120),  # (24 + 2 x 8) x 128
    "fc1": ((4096,), 3072, 16384),  # SwiGLU: 2 x 8192
    "fc2": ((4096,), 8192, 3072),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fp8_format, recipe, wgrad", CASES)
def test_equals_the_reference_on_the_gpu(shape, fp8_format, recipe, wgrad):
    check_against_reference(*SHAPES[shape], fp8_format, recipe, wgrad, device="cuda", forward_rtol=3e-2)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("wgrad", [True, False])
def test_weight_gradient_in_main_grad_on_the_gpu(shape, wgrad):
    check_against_reference(*SHAPES[shape], "hybrid", "delayed", wgrad, device="cuda", fusion=True,
                            forward_rtol=3e-2, fp32_rtol=2**-7 if wgrad else 1e-4)


@pytest.mark.parametrize("rows, columns", [(4096, 3072), (15, 48), (3072, 16384)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_quantizations_equal_the_eager_functions(rows, columns, dtype):
    x = torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16) * 3
    scale = torch.tensor(50.0, device="cuda")

    def assert_same(compiled, eager):
        for got, wanted in zip(compiled, eager):
            if got is None or got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                assert (got is None and wanted is None) or (
                    got.is_contiguous() and torch.equal(got.view(torch.uint8), wanted.view(torch.uint8)))
            else:  # scales: a reciprocal may round differently
                torch.testing.assert_close(got, wanted, rtol=2e-7, atol=0)

    for delayed in (quantize_with_amax, quantize_with_amax_and_transpose):
        assert_same(delayed(x, scale, dtype), delayed.eager(x, scale, dtype))
    for current in (quantize_current, quantize_current_and_transpose):
        assert_same(current(x, dtype, 1), current.eager(x, dtype, 1))
    assert_same([quantize_transposed(x, scale, dtype)], [quantize_transposed.eager(x, scale, dtype)])


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs Triton")
@pytest.mark.parametrize("rows, columns", [(4096, 3072), (15, 48), (3072, 16384), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_kernel_equals_the_eager_functions(rows, columns, dtype):
    """(256, 256): every bf16 bit pattern once, at scales below, across and beyond the FP8 range."""
    if (rows, columns) == (256, 256):
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256).cuda()
        scales = (1.0, 7.3, 2.0**-20, 2.0**40, 3.0e38)
    else:
        x = torch.randn(rows, columns, device="cuda", dtype=torch.bfloat16) * 3
        scales = (50.0,)
    for value in scales:
        scale, scale_inv, running = (torch.tensor(v, device="cuda") for v in (value, 0.0, 0.0))
        data, transposed, expected_inv, amax = quantize_with_amax_and_transpose.eager(x, scale, dtype)
        q, qt = quantize_fused(x, scale, scale_inv, dtype, transpose_padding=16, amax=running)
        assert torch.equal(q.view(torch.uint8), data.view(torch.uint8)), value
        assert torch.equal(qt.view(torch.uint8), transposed.view(torch.uint8)), value
        assert torch.equal(running, amax) or (running.isnan() and amax.isnan())
        assert torch.equal(scale_inv, expected_inv), value
        _, weight_t = quantize_fused(x, scale, scale_inv, dtype, data=False, transpose_padding=1)
        assert torch.equal(weight_t.view(torch.uint8), quantize_transposed.eager(x, scale, dtype).view(torch.uint8))
