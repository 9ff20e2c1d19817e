"""FP8 quantization on one GPU: the Inductor-generated kernels (megatron/core/fp8/quantize.py through
torch.compile, the path before triton_quantize.py) against the hand-written Triton kernel, and one FP8
linear's forward + backward against bf16's `F.linear`, at the GEMM shapes of the benchmark models.

    python tools/bench/fp8_quantize.py              # GPT 1.3B and Llama-style 3.6B (meant to take < 2 min)
    python tools/bench/fp8_quantize.py --sweep      # also the Triton kernel's time per tile shape

Per GEMM Y = X W^T (X [M, K], W [N, K], M tokens of one microbatch), microseconds (median of
`triton.testing.do_bench`):
- X: q_X and q_X^T (E4M3) with the amax folded into the running amax, as each forward does;
- dY: the same for the output gradient [M, N] (E5M2, --fp8-format hybrid), as each backward does;
- W: what one microbatch spends on its weight: Inductor q_W in the forward and q_W^T in the backward;
  Triton both in one pass (made once per step and reused by every microbatch);
- fwd+bwd: Y, dX and dW of `F.linear` in bf16, and of `fp8_linear` with the quantizations of each kind
  (the weight quantized anew each time: one microbatch per step, the least favourable case for FP8).
Triton TB/s: the X kernel's bytes (2 read + 2 written per element) over its time. Bit-equality of the two
kinds is checked on every shape (q, q^T, amax, 1 / scale; Y, dX, dW of fp8_linear): the `equal` column.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.core.fp8 import Fp8Recipe, Fp8Scaling, fp8_linear, triton_quantize  # noqa: E402
from megatron.core.fp8.quantize import (  # noqa: E402
    quantize_transposed,
    quantize_with_amax,
    quantize_with_amax_and_transpose,
)
from megatron.core.fp8.triton_quantize import quantize_fused  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# model: (tokens per microbatch, bias, {GEMM: (N, K)})
MODELS = {
    "gpt-1.3b": (4 * 2048, True, {"qkv": (6144, 2048), "proj": (2048, 2048), "fc1": (8192, 2048),
                                  "fc2": (2048, 8192)}),
    "llama-3.6b": (4096, False, {"qkv": (5120, 3072), "proj": (3072, 3072), "fc1": (16384, 3072),
                                 "fc2": (3072, 8192)}),
}
SWEEP = [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8), (64, 256, 8), (128, 64, 4)]


def microseconds(function, grad_to_none=None) -> float:
    return 1e3 * triton.testing.do_bench(function, warmup=10, rep=40, grad_to_none=grad_to_none,
                                         return_mode="median")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (E4M3, E5M2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def activation_quantization(x: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(Inductor us, Triton us, equal) of q, q^T padded to 16 and the amax fold of x."""
    scale, running, scale_inv = (torch.tensor(value, device="cuda") for value in (3.0, 0.0, 0.0))

    def inductor():
        data, transposed, inverse, amax = quantize_with_amax_and_transpose(x, scale, dtype)
        torch.maximum(running, amax, out=running)
        return data, transposed, inverse

    def fused():
        return quantize_fused(x, scale, scale_inv, dtype, transpose_padding=16, amax=running)

    data, transposed, inverse = inductor()
    inductor_amax = running.clone()
    running.zero_()
    q, qt = fused()
    equal = (same_bits(q, data) and same_bits(qt, transposed) and same_bits(running, inductor_amax)
             and same_bits(scale_inv, inverse))
    return microseconds(inductor), microseconds(fused), equal


def weight_quantization(weight: torch.Tensor) -> tuple:
    """(Inductor us, Triton us, equal) of q_W and q_W^T with the amax fold."""
    scale, running, scale_inv = (torch.tensor(value, device="cuda") for value in (300.0, 0.0, 0.0))

    def inductor():
        data, _, inverse, amax = quantize_with_amax(weight, scale, E4M3)
        torch.maximum(running, amax, out=running)
        return data, quantize_transposed(weight, scale, E4M3), inverse

    def fused():
        return quantize_fused(weight, scale, scale_inv, E4M3, transpose_padding=1, amax=running)

    data, transposed, inverse = inductor()
    q, qt = fused()
    equal = same_bits(q, data) and same_bits(qt, transposed) and same_bits(scale_inv, inverse)
    return microseconds(inductor), microseconds(fused), equal


def linear_forward_backward(tokens: int, out_features: int, in_features: int, bias: bool) -> tuple:
    """(bf16 us, FP8 Inductor us, FP8 Triton us, equal) of Y, dX and dW."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, in_features, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(out_features, in_features, device="cuda", generator=generator)).bfloat16()
    weight = torch.nn.Parameter(weight)
    bias_param = torch.nn.Parameter(torch.zeros(out_features, device="cuda", dtype=torch.bfloat16)) if bias else None
    dy = 1e-3 * torch.randn(tokens, out_features, device="cuda", generator=generator).bfloat16()
    parameters = [x, weight] + ([bias_param] if bias else [])

    def bf16():
        F.linear(x, weight, bias_param).backward(dy)

    scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed"), torch.device("cuda"))
    scaling.meta[0] = torch.tensor([20.0, 300.0, 5e4])

    def fp8():
        scaling.drop_quantized_weight()  # one microbatch per step: the weight is quantized every time
        output = fp8_linear(x, weight, bias_param, scaling)
        output.backward(dy)
        return output

    results = {}
    for enabled in (False, True):
        triton_quantize.ENABLED = enabled
        for parameter in parameters:
            parameter.grad = None
        output = fp8()
        results[enabled] = [output, x.grad, weight.grad, microseconds(fp8, parameters)]
    triton_quantize.ENABLED = True
    equal = all(same_bits(a, b) for a, b in zip(results[False][:3], results[True][:3]))
    return microseconds(bf16, parameters), results[False][3], results[True][3], equal


def sweep(tokens: int, shapes: dict) -> None:
    scale, running, scale_inv = (torch.tensor(value, device="cuda") for value in (3.0, 0.0, 0.0))
    for in_features in sorted({k for _, k in shapes.values()}):
        x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
        times = [microseconds(lambda: quantize_fused(x, scale, scale_inv, E4M3, transpose_padding=16, amax=running,
                                                     config=config)) for config in SWEEP]
        print(f"  sweep X [{tokens}, {in_features}]: " + ", ".join(
            f"{config}: {time:.0f} us" for config, time in zip(SWEEP, times)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sweep", action="store_true", help="time the Triton kernel's other tile shapes too")
    options = parser.parse_args()
    start = time.perf_counter()
    rows = ["| model | GEMM [M, N, K] | X Inductor / Triton us (Triton TB/s) | dY Inductor / Triton us | "
            "W Inductor / Triton us | fwd+bwd bf16 / FP8 Inductor / FP8 Triton us | bf16 / FP8 Triton | equal |",
            "|---|---|---|---|---|---|---|---|"]
    for name in options.models.split(","):
        tokens, bias, shapes = MODELS[name]
        totals = [0.0] * 9
        for gemm, (out_features, in_features) in shapes.items():
            x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
            dy = 1e-3 * torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
            weight = 0.02 * torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
            x_times, dy_times = activation_quantization(x, E4M3), activation_quantization(dy, E5M2)
            w_times = weight_quantization(weight)
            linear_times = linear_forward_backward(tokens, out_features, in_features, bias)
            del x, dy, weight
            times = x_times[:2] + dy_times[:2] + w_times[:2] + linear_times[:3]
            totals = [total + time for total, time in zip(totals, times)]
            equal = all(part[-1] for part in (x_times, dy_times, w_times, linear_times))
            bandwidth = 4 * tokens * in_features / x_times[1] / 1e6
            line = (f"| {name} | {gemm} [{tokens}, {out_features}, {in_features}] | {times[0]:.0f} / {times[1]:.0f} "
                    f"({bandwidth:.2f}) | {times[2]:.0f} / {times[3]:.0f} | {times[4]:.0f} / {times[5]:.0f} | "
                    f"{times[6]:.0f} / {times[7]:.0f} / {times[8]:.0f} | {times[6] / times[8]:.2f}x | "
                    f"{'yes' if equal else 'NO'} |")
            print(line, flush=True)
            rows.append(line)
        rows.append(f"| {name} | one layer (4 GEMMs) | {totals[0]:.0f} / {totals[1]:.0f} | {totals[2]:.0f} / "
                    f"{totals[3]:.0f} | {totals[4]:.0f} / {totals[5]:.0f} | {totals[6]:.0f} / {totals[7]:.0f} / "
                    f"{totals[8]:.0f} | {totals[6] / totals[8]:.2f}x | |")
        if options.sweep:
            sweep(tokens, shapes)
        torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"Triton tile (rows, columns, warps) {triton_quantize.DEFAULT_CONFIG}, {time.perf_counter() - start:.0f} s")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
