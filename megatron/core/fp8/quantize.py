"""Per-tensor FP8 quantization: q = saturate(x * scale) in E4M3 or E5M2, and the amax it records.

    saturate(v) = clamp(v, -fp8_max, fp8_max)   fp8_max: 448 (E4M3), 57344 (E5M2); then round to nearest even

Values beyond the representable range become +-fp8_max instead of inf/NaN (NaN stays NaN, so a bad step
is still seen). `torch._scaled_mm` takes the inverse scales: (q_a * scale_inv_a) @ (q_b * scale_inv_b).

On CUDA each function below runs compiled (`cuda_fuser`: Inductor generates the kernels); on CPU the same
functions run eagerly. They define the results: the delayed-scaling quantizations of the scaling state run
in triton_quantize.py's kernel on GPUs (one launch instead of Inductor's several, the amax folded on the
device), which gives the same bits; the tensorwise recipe runs these.

A dW GEMM sums over tokens, so it takes its operands transposed, [features, tokens], with the token count M
padded to a multiple of 16 by zero tokens (zeros add nothing to the sum); `transpose=True` asks for that.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from megatron.core.fp8.recipe import GEMM_ALIGNMENT
from megatron.core.fusions.cuda_fuser import cuda_fuser

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FP32_MAX = torch.finfo(torch.float32).max


class Fp8Tensor(NamedTuple):
    """A quantized operand: `data` stands for data * scale_inv."""

    data: torch.Tensor  # float8 [rows, columns]
    scale: torch.Tensor | None  # 0-dim fp32: data = saturate(x * scale) (None: a weight stored in FP8, params.py)
    scale_inv: torch.Tensor  # 0-dim fp32: 1 / scale
    transposed: torch.Tensor | None = None  # float8 [columns, rows padded to 16], contiguous, if asked for


def saturating_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) as `dtype` (the product in fp32)."""
    fp8_max = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def exact_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x correctly rounded to fp32, eager or compiled: Triton's fp32 division (what Inductor emits for
    `1 / x`) may be an ulp off, its fp64 division is exact, and an fp64 quotient of fp32 operands rounds to the
    correctly rounded fp32 one (53 >= 2 x 24 + 2 bits)."""
    return x.double().reciprocal().float()


def scale_from_amax(amax: torch.Tensor, fp8_max, margin: int, fallback: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax / 2^margin where amax is positive and finite, else `fallback`; an overflowing scale
    (a tiny amax) becomes the largest fp32 (Transformer Engine's `_default_sf_compute`). Correctly rounded
    (in fp64, as `exact_reciprocal`), so that a compiled cast and an eager one use the same scale: the FP8
    weights' cast (eager) and a bf16 weight's (compiled, tensorwise) give the same bytes."""
    numerator = torch.as_tensor(fp8_max, dtype=torch.float64, device=amax.device)  # a float x / t would be
    scale = (numerator / amax.double() / 2.0**margin).float()                          # reciprocal(t) * x
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, fallback)
    return torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)


def _transposed_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x^T * scale) [columns, rows padded to 16], contiguous, zero-padded. The padding comes from
    x's shape, so a compiled version serves every token count."""
    return saturating_cast(F.pad(x.t(), (0, -x.shape[0] % GEMM_ALIGNMENT)), scale, dtype).contiguous()


def _delayed(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool):
    transposed = _transposed_cast(x, scale, dtype) if transpose else None
    return saturating_cast(x, scale, dtype), transposed, exact_reciprocal(scale), x.abs().amax().float()


def _current(x: torch.Tensor, dtype: torch.dtype, margin: int, transpose: bool):
    amax = x.abs().amax().float()
    scale = scale_from_amax(amax, FP8_MAX[dtype], margin, torch.ones_like(amax))
    transposed = _transposed_cast(x, scale, dtype) if transpose else None
    return saturating_cast(x, scale, dtype), transposed, scale, exact_reciprocal(scale)


# One compiled function per kind of call (dynamo keeps a few variants of each: FP8 dtype, static and then
# dynamic shapes), so none runs out of its recompilation budget.
@cuda_fuser
def quantize_with_amax(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """(q, None, 1 / scale, max|x| in fp32) with q = saturate(x * scale): the delayed-scaling cast, which
    records the amax that later scales are computed from."""
    return _delayed(x, scale, dtype, transpose=False)


@cuda_fuser
def quantize_with_amax_and_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """`quantize_with_amax` with q^T for a dW GEMM in place of None."""
    return _delayed(x, scale, dtype, transpose=True)


@cuda_fuser
def quantize_current(x: torch.Tensor, dtype: torch.dtype, margin: int):
    """(q, None, scale, scale_inv) with the scale from x's own amax (tensorwise recipe; scale 1 for x = 0)."""
    return _current(x, dtype, margin, transpose=False)


@cuda_fuser
def quantize_current_and_transpose(x: torch.Tensor, dtype: torch.dtype, margin: int):
    """`quantize_current` with q^T for a dW GEMM in place of None."""
    return _current(x, dtype, margin, transpose=True)


_compiled_saturating_cast = cuda_fuser(saturating_cast)


def quantize_rounded(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rounded_to: torch.dtype) -> torch.Tensor:
    """saturate(round(x) * scale) as `dtype`, x rounded to `rounded_to` first (an fp32 main param to the bf16 its
    model weight would hold). The rounding is an eager cast (a transient copy of x in `rounded_to`) and only
    the cast of the rounded tensor is compiled, as a bf16 weight's is: Inductor's Triton code computes
    through a rounding cast in fp32 even with `emulate_precision_casts` (torch 2.11), and the bytes then
    differed from a bf16 weight's in ~1.5% of the elements (the losses from a bf16-weight run's by 0.3% in
    three steps on an H100)."""
    return _compiled_saturating_cast(x.to(rounded_to), scale, dtype)


@cuda_fuser
def quantize_transposed(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x^T * scale), contiguous: x [rows, cols] -> [cols, rows] (a weight for the dX GEMM)."""
    return saturating_cast(x.t(), scale, dtype).contiguous()
