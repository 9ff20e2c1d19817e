"""Time of one mixed-precision AdamW step on one GPU: torch's fused AdamW followed by the copy into the bf16
model params (the path before fusions/fused_adamw.py) against the Triton kernel that does both in one pass,
with fp32 moments and with bf16 moments (--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16).

    python tools/bench/optimizer_step.py                   # GPT 1.3B and Llama-style 3.6B parameter shapes

The parameters have the shapes of the benchmark models (per layer: QKV, projection, MLP, norms; embeddings,
output layer), fp32 main params and gradients, bf16 model params, AdamW with two param groups (decay, no
decay) and a gradient-clipping scale, as in training. Reported: milliseconds per step (median of 20) and
the effective bandwidth over the bytes each path must move (torch: 28 + 6 bytes per param in two passes;
fused: 30 bytes in one, 22 with bf16 moments).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.core.fusions.fused_adamw import FusedAdamW  # noqa: E402

# name: (layers, hidden, ffn, query groups / heads, vocab, swiglu, biases, untied output layer)
MODELS = {
    "gpt-1.3b": (24, 2048, 8192, 1.0, 50304, False, True, False),
    "llama-3.6b": (28, 3072, 8192, 8 / 24, 128256, True, False, True),
}


def parameter_shapes(layers, hidden, ffn, kv_fraction, vocab, swiglu, biases, untied) -> list:
    qkv = int(hidden * (1 + 2 * kv_fraction))
    per_layer = [(qkv, hidden), (hidden, hidden), ((2 if swiglu else 1) * ffn, hidden), (hidden, ffn),
                 (hidden,), (hidden,)]
    if biases:
        per_layer += [(qkv,), (hidden,), (ffn,), (hidden,), (hidden,), (hidden,)]
    return [(vocab, hidden)] * (1 + untied) + per_layer * layers + [(hidden,)]


def build(shapes, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    main = [torch.randn(shape, device="cuda", generator=generator) for shape in shapes]
    for param in main:
        param.grad = torch.randn(param.shape, device="cuda", generator=generator) * 1e-2
    model = [param.bfloat16() for param in main]
    groups = [{"params": [p for p in main if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for p in main if p.dim() == 1], "weight_decay": 0.0}]
    return main, model, torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)


def milliseconds(step, repeats: int = 20) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def torch_step_ms(shapes, grad_scale) -> float:
    """torch's fused AdamW step, then the copy into the bf16 model params."""
    main, model, optimizer = build(shapes, 0)

    def step():
        optimizer.grad_scale = grad_scale
        optimizer.step()
        torch._foreach_copy_(model, main)

    return milliseconds(step)


def fused_step_ms(shapes, grad_scale, **options) -> float:
    """The Triton AdamW (with the copy) built with `options`; its tensors are freed when this returns."""
    main, model, optimizer = build(shapes, 0)
    fused = FusedAdamW(optimizer, **options)
    model_of = dict(zip(main, model))
    return milliseconds(lambda: fused.step(model_of, grad_scale))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sweep", default="", help="also time the Triton kernel at these block:warps, e.g. "
                                                      "'4096:8,8192:8'")
    options = parser.parse_args()
    sweep = [tuple(int(v) for v in entry.split(":")) for entry in options.sweep.split(",") if entry]
    rows = ["| model | params | torch fused AdamW + copy | Triton AdamW with copy | speed-up | same, bf16 moments |",
            "|---|---|---|---|---|---|"]
    for name in options.models.split(","):
        shapes = parameter_shapes(*MODELS[name])
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        grad_scale = torch.tensor([1.5], device="cuda")

        torch_ms = torch_step_ms(shapes, grad_scale)
        torch.cuda.empty_cache()
        fused_ms = fused_step_ms(shapes, grad_scale)
        torch.cuda.empty_cache()
        bf16_moments_ms = fused_step_ms(shapes, grad_scale, exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16)
        torch.cuda.empty_cache()

        def bandwidth(ms, bytes_per_param):
            return f"{bytes_per_param * numel / ms / 1e9:.2f} TB/s"

        rows.append(f"| {name} | {numel / 1e9:.2f}B | {torch_ms:.1f} ms ({bandwidth(torch_ms, 34)}) | "
                    f"{fused_ms:.1f} ms ({bandwidth(fused_ms, 30)}) | {torch_ms / fused_ms:.2f}x | "
                    f"{bf16_moments_ms:.1f} ms ({bandwidth(bf16_moments_ms, 22)}) |")
        for block, warps in sweep:
            swept_ms = fused_step_ms(shapes, grad_scale, block_size=block, num_warps=warps)
            rows.append(f"| {name}, block {block}, {warps} warps | | | {swept_ms:.1f} ms "
                        f"({bandwidth(swept_ms, 30)}) | | |")
            torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
