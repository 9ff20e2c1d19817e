"""Causal attention forward + backward through each SDPA backend, at the benchmark models' shapes (one GPU).

    python tools/bench/attention_backends.py

Prints milliseconds per forward+backward and TFLOP/s (causal: 2 * 2 * b * heads * s^2 * d / 2 forward, 2.5x
that for forward + backward) for the flash, cuDNN and memory-efficient backends, and the largest difference
of each backend's output and input gradients from the flash backend's, so that a faster backend is only
chosen where it computes the same function.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

# name: (batch, query heads, key/value heads, sequence, head dim)
SHAPES = {
    "gpt2-small": (8, 12, 12, 1024, 64),
    "gpt-1.3b": (4, 16, 16, 2048, 128),
    "llama-3.6b mbs1": (1, 24, 8, 4096, 128),
    "llama-3.6b mbs2": (2, 24, 8, 4096, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def run(backend, q, k, v, grad):
    with sdpa_kernel([backend]):
        for tensor in (q, k, v):
            tensor.grad = None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
        out.backward(grad)
    return out, q.grad, k.grad, v.grad


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | backend | ms fwd+bwd | TFLOP/s | max diff vs flash (out, dq, dk, dv) |")
    print("|---|---|---|---|---|")
    for name, (b, heads, groups, s, d) in SHAPES.items():
        torch.manual_seed(0)
        q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)
        flops = 2.5 * 2 * 2 * b * heads * s * s * d / 2
        expected = None
        for label, backend in BACKENDS.items():
            try:
                results = run(backend, q, k, v, grad)
                ms = do_bench(lambda: run(backend, q, k, v, grad), warmup=25, rep=100, return_mode="median")
            except RuntimeError as error:
                print(f"| {name} | {label} | unavailable: {str(error).splitlines()[0][:80]} | | |")
                continue
            results = [tensor.detach().float() for tensor in results]
            expected = expected or results
            diffs = ", ".join(f"{(got - ref).abs().max().item():.1e}" for got, ref in zip(results, expected))
            print(f"| {name} | {label} | {ms:.2f} | {flops / ms / 1e9:.0f} | {diffs} |", flush=True)


if __name__ == "__main__":
    main()
