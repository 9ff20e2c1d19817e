"""The delayed-scaling quantization as one hand-written Triton kernel: one read of x, every output in that pass.

For x [rows, columns] (bf16/fp16/fp32, contiguous), the scale s (a 0-dim fp32 tensor on the device) and an
FP8 dtype, one launch writes

    q      = saturate(x * s)                      [rows, columns] row-major             (if asked)
    q^T    = saturate(x^T * s)                    [columns, rows'] row-major, rows' = rows rounded up to
                                                  `transpose_padding`, the extra columns zeros          (if asked)
    amax  <- max(amax, max |x|)                   folded into a running fp32 amax on the device         (if asked)
    s_inv  = 1 / s                                correctly rounded, as `torch.reciprocal`, by program 0

with the semantics of quantize.py's `saturating_cast` (fp32 product, clamp to +-fp8_max with NaN kept,
round to nearest even), so q, q^T and the amax equal the Inductor/eager functions there bit for bit. Nothing
is read back to the host.

Tiles: each program loads one [BLOCK_ROWS, BLOCK_COLUMNS] tile of x (coalesced along the columns), stores
its q tile along the columns and the transposed tile along the rows of q^T (Triton stages the transpose in
shared memory), so both stores are contiguous runs that Triton writes as 16-byte vectors when the sizes are
multiples of 16 (the GEMM sizes are). The grid covers rows' rows, so the zero padding of q^T comes from the
masked load (0 * s, as the reference's padded product).

amax: max |x| is a max over non-negative fp32 values, whose IEEE bit patterns order as int32 the same way,
with every NaN (sign bit cleared) above inf: each program reduces the int32 bits of |x| over its tile and
folds them into the running amax with one `atomic_max` on its int32 bits. So a NaN anywhere in x makes the
amax NaN, as `x.abs().amax()` and `torch.maximum` do (the step is then seen as bad), and the order in which
programs finish does not matter (the result is deterministic).

The cast: on a GPU the hardware conversion (`cvt.rn.satfinite`: round to nearest even, which Inductor's
kernels use too). Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) rounds FP8 differently (half
away from zero, no carry into the exponent, no NaN), so there the kernel rounds in integer arithmetic
(`_fp8_bits_exact`), which follows torch's `Float8_e4m3fn` / `Float8_e5m2` conversion exactly.
"""

import functools
import importlib.util
import os
import struct

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
ENABLED = True
"""False sends every quantization through quantize.py's Inductor/eager functions (the reference)."""

# Tile of one program (rows, columns, warps): 64 x 128 bf16 = 16 KiB in flight per program.
DEFAULT_CONFIG = (64, 128, 8)
_INT32_LIMIT = 2**31

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_bits_exact(v, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr):
        """saturate(v) rounded to nearest even as FP8 bits (uint8), in integer arithmetic; NaN -> 0x7F | sign.
        MANTISSA, BIAS: the FP8 format's mantissa bits and exponent bias; MAX_BITS: fp32 bits of fp8_max."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        magnitude = bits & 0x7FFFFFFF
        nan = magnitude > 0x7F800000
        magnitude = tl.minimum(magnitude, MAX_BITS)  # non-negative floats order as their bits: the clamp
        exponent = magnitude >> 23
        normal = exponent > 127 - BIAS  # an FP8 normal number (FP8 exponent field >= 1)
        # Normal: re-bias the exponent in place, drop 23 - MANTISSA bits (a carry rounds into the exponent).
        # Subnormal: the significand with its leading 1, shifted further by how far below the normal range.
        shift = tl.where(normal, 23 - MANTISSA, tl.minimum(23 - MANTISSA + 128 - BIAS - exponent, 31))
        significand = tl.where(normal, magnitude - ((127 - BIAS) << 23), (magnitude & 0x7FFFFF) | 0x800000)
        rounded = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
        return (tl.where(nan, 0x7F, rounded) | sign).to(tl.uint8)

    @triton.jit
    def _quantize_kernel(
        x_ptr, q_ptr, qt_ptr, scale_ptr, scale_inv_ptr, amax_ptr, rows, columns, qt_rows,
        FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
        MAX_BITS: tl.constexpr, EXACT_CAST: tl.constexpr, WRITE_Q: tl.constexpr, TRANSPOSE: tl.constexpr,
        RECORD: tl.constexpr, WIDE_INDEX: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
    ):
        column_block, row_block = tl.program_id(0), tl.program_id(1)
        row = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        column = column_block * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        if WIDE_INDEX:
            row, column = row.to(tl.int64), column.to(tl.int64)
        in_x = (row[:, None] < rows) & (column[None, :] < columns)
        x = tl.load(x_ptr + row[:, None] * columns + column[None, :], mask=in_x, other=0.0)
        if EXACT_CAST and x_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter mis-converts bf16 subnormals
            x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        x = x.to(tl.float32)
        scale = tl.load(scale_ptr)
        product = x * scale
        if EXACT_CAST:
            q = _fp8_bits_exact(product, MANTISSA, BIAS, MAX_BITS).to(FP8, bitcast=True)
        else:
            q = tl.clamp(product, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(FP8)
        if WRITE_Q:
            tl.store(q_ptr + row[:, None] * columns + column[None, :], q, mask=in_x)
        if TRANSPOSE:
            in_qt = (column[:, None] < columns) & (row[None, :] < qt_rows)
            tl.store(qt_ptr + column[:, None] * qt_rows + row[None, :], tl.trans(q), mask=in_qt)
        if RECORD:
            magnitude = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            tile_max = tl.max(tl.max(magnitude, axis=1), axis=0)
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tile_max, sem="relaxed")
        if (row_block == 0) & (column_block == 0):
            # In fp64 (no flush of a subnormal 1 / scale), then rounded to fp32: the same as the correctly
            # rounded fp32 division, as 53 >= 2 * 24 + 2 bits make the double rounding innocuous.
            tl.store(scale_inv_ptr, (1.0 / scale.to(tl.float64)).to(tl.float32))


def _fp32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


# torch dtype: (Triton dtype, fp8_max, mantissa bits, exponent bias, fp32 bits of fp8_max)
_FORMATS = {}
if TRITON_AVAILABLE:
    _FORMATS = {dtype: (triton_dtype, fp8_max, mantissa, bias, _fp32_bits(fp8_max))
                for dtype, triton_dtype, fp8_max, mantissa, bias in ((torch.float8_e4m3fn, tl.float8e4nv, 448.0, 3, 7),
                                                                      (torch.float8_e5m2, tl.float8e5, 57344.0, 2, 15))}


@functools.cache
def _device_has_fp8(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def runs_in_triton(x: torch.Tensor) -> bool:
    """Whether the quantization of `x` runs in `quantize_fused`: a CUDA tensor on a GPU with FP8 (compute
    capability 8.9+), or any tensor while Triton interprets (tests); else quantize.py's functions run."""
    return ENABLED and TRITON_AVAILABLE and (INTERPRETING or x.is_cuda and _device_has_fp8(x.device))


def quantize_fused(x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, *,
                   data: bool = True, transpose_padding: int | None = None, amax: torch.Tensor | None = None,
                   config: tuple = DEFAULT_CONFIG):
    """(q or None, q^T or None) of x [rows, columns] (module docstring), one launch.

    scale: 0-dim fp32, read on the device; scale_inv: 0-dim fp32, written 1 / scale; `data`: write q;
    `transpose_padding`: write q^T [columns, rows rounded up to it] (16 for a dW GEMM operand, 1 for a
    weight's dX operand), None for none; amax: a 0-dim non-negative fp32 running amax to fold max|x| into,
    None for none; config: (BLOCK_ROWS, BLOCK_COLUMNS, warps)."""
    x = x.contiguous()
    rows, columns = x.shape
    q = torch.empty((rows, columns), dtype=dtype, device=x.device) if data else None
    qt, qt_rows = None, rows
    if transpose_padding is not None:
        qt_rows = rows + (-rows % transpose_padding)
        qt = torch.empty((columns, qt_rows), dtype=dtype, device=x.device)
    triton_dtype, fp8_max, mantissa, bias, max_bits = _FORMATS[dtype]
    block_rows, block_columns, warps = config
    grid = (triton.cdiv(columns, block_columns), triton.cdiv(qt_rows, block_rows))
    _quantize_kernel[grid](
        x, q if data else qt, qt if qt is not None else q, scale, scale_inv, amax if amax is not None else scale,
        rows, columns, qt_rows, FP8=triton_dtype, FP8_MAX=fp8_max, MANTISSA=mantissa, BIAS=bias,
        MAX_BITS=max_bits, EXACT_CAST=INTERPRETING, WRITE_Q=data, TRANSPOSE=qt is not None,
        RECORD=amax is not None, WIDE_INDEX=max(rows, qt_rows) * columns >= _INT32_LIMIT,
        BLOCK_ROWS=block_rows, BLOCK_COLUMNS=block_columns, num_warps=warps,
    )
    return q, qt
