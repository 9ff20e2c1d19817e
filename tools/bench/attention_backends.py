"""Causal attention forward + backward through each SDPA backend, at the benchmark models' shapes (one GPU).

    python tools/bench/attention_backends.py

Prints milliseconds per forward+backward and TFLOP/s (causal: 2 * 2 * b * heads * s^2 * d / 2 forward, 2.5x
that for forward + backward) for the flash, cuDNN and memory-efficient backends, and the largest difference
of each backend's output and input gradients from the flash backend's, so that a faster backend is only
chosen where it computes the same function. Each shape runs in two memory layouts: `bhsd` (contiguous
[b, heads, s, d], as SDPA's documentation uses) and `sbhd` ([s, b, heads, d] permuted to [b, heads, s, d], the
strided view that the model's sequence-first attention passes to SDPA).
"""

import itertools

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


def run(backend, q, k, v, grad, layout):
    """Forward + backward; inputs and gradients are leaves in `layout`, SDPA sees [b, heads, s, d]."""
    with sdpa_kernel([backend]):
        for tensor in (q, k, v):
            tensor.grad = None
        views = [t.permute(1, 2, 0, 3) if layout == "sbhd" else t for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=views[1].size(1) != views[0].size(1))
        out.backward(grad)
    return out, q.grad, k.grad, v.grad


def make_inputs(b, heads, groups, s, d, layout):
    """q, k, v (leaves) and the output gradient, seeded, in `layout`."""
    torch.manual_seed(0)
    shape = (lambda h: (s, b, h, d)) if layout == "sbhd" else (lambda h: (b, h, s, d))
    q, k, v = (torch.randn(*shape(h), device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, groups, groups))
    return q, k, v, torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | backend | ms fwd+bwd | TFLOP/s | max diff vs flash (out, dq, dk, dv) |")
    print("|---|---|---|---|---|")
    for (name, (b, heads, groups, s, d)), layout in itertools.product(SHAPES.items(), ("bhsd", "sbhd")):
        q, k, v, grad = make_inputs(b, heads, groups, s, d, layout)
        name = f"{name} {layout}"
        flops = 2.5 * 2 * 2 * b * heads * s * s * d / 2
        expected = None
        for label, backend in BACKENDS.items():
            try:
                results = run(backend, q, k, v, grad, layout)
                ms = do_bench(lambda: run(backend, q, k, v, grad, layout), warmup=25, rep=100, return_mode="median")
            except RuntimeError as error:
                print(f"| {name} | {label} | unavailable: {str(error).splitlines()[0][:80]} | | |")
                continue
            results = [tensor.detach().float() for tensor in results]
            expected = expected or results
            diffs = ", ".join(f"{(got - ref).abs().max().item():.1e}" for got, ref in zip(results, expected))
            print(f"| {name} | {label} | {ms:.2f} | {flops / ms / 1e9:.0f} | {diffs} |", flush=True)


if __name__ == "__main__":
    main()
