"""How much of the AdamW step could hide under the next forward pass on one GPU.

    python tools/bench/optimizer_overlap.py                  # GPT 1.3B: 24 layers, 8192 tokens, h 2048
    python tools/bench/optimizer_overlap.py --layers 28 --hidden 3072 --ffn 8192 --heads 24

The optimizer step (the Triton AdamW over fp32 main params, bf16 moments, copying into the bf16 model params)
is bound by memory bandwidth; the forward pass's GEMMs by compute. A step whose update runs layer by layer on a
side stream, each layer's forward waiting only for its own layer's update, would overlap the two. This times,
with the benchmark model's layer shapes (QKV, cuDNN causal attention, projection, FC1, GELU, FC2):
- the forward pass alone, the per-layer updates alone, and the two one after the other on one stream;
- the two overlapped: layer k's update on a side stream, layer k's forward waiting for its event; with
  `--carveouts`, the forward's GEMMs also leave that many SMs to the update (cuBLAS's SM count target).
Reported: ms (median of 20 after 3 warm-ups) and the share of the update's time the overlap hides. A probe for
the design, not a path of the trainer. Measured (one H100, 2026-11-28): the GPT 1.3B's update (11.1 ms) hides
not at all (-10%; 3% for the 3.6B's layers), and leaving it 8-48 SMs makes it worse (-19% to -98%): the update
needs the whole memory bandwidth and the GEMMs every SM, so the two take turns.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.core.fusions.fused_adamw import FusedAdamW  # noqa: E402
from optimizer_step import milliseconds  # noqa: E402 (this directory: the same timing as the optimizer's bench)


def build_layer(hidden: int, ffn: int, generator):
    """One layer's fp32 main params (with gradients), their bf16 model copies and its FusedAdamW."""
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn),
              (3 * hidden,), (hidden,), (ffn,), (hidden,), (hidden,), (hidden,)]
    main = [torch.randn(shape, device="cuda", generator=generator) * 0.02 for shape in shapes]
    for param in main:
        param.grad = torch.randn(param.shape, device="cuda", generator=generator) * 1e-3
    model = [param.bfloat16() for param in main]
    groups = [{"params": [p for p in main if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for p in main if p.dim() == 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))
    fused = FusedAdamW(optimizer, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    return model, fused, dict(zip(main, model))


def forward_layer(x, model, heads: int):
    qkv_w, proj_w, fc1_w, fc2_w, qkv_b, proj_b, fc1_b, fc2_b = model[:8]
    tokens, hidden = x.shape
    q, k, v = F.linear(x, qkv_w, qkv_b).view(tokens // 2048, 2048, 3, heads, hidden // heads).unbind(2)
    attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
    x = x + F.linear(attention.transpose(1, 2).reshape(tokens, hidden), proj_w, proj_b)
    return x + F.linear(F.gelu(F.linear(x, fc1_w, fc1_b), approximate="tanh"), fc2_w, fc2_b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8192, help="a multiple of the sequence length 2048")
    parser.add_argument("--carveouts", default="0", help="SMs the forward's GEMMs leave to the update running "
                                                          "beside them (cuBLAS's SM count target), e.g. 0,16,32")
    options = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    layers = [build_layer(options.hidden, options.ffn, generator) for _ in range(options.layers)]
    clip = torch.tensor([1.0], device="cuda")
    x0 = torch.randn(options.tokens, options.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    side = torch.cuda.Stream()

    @torch.no_grad()
    def forward():
        x = x0
        for model, _, _ in layers:
            x = forward_layer(x, model, options.heads)

    def update():
        for _, fused, model_of in layers:
            fused.step(model_of, clip)

    def sequential():
        update()
        forward()

    @torch.no_grad()
    def overlapped(carveout: int):
        side.wait_stream(torch.cuda.current_stream())
        done = []
        with torch.cuda.stream(side):
            for _, fused, model_of in layers:
                fused.step(model_of, clip)
                done.append(torch.cuda.Event())
                done[-1].record()
        x = x0
        torch._C._set_sm_carveout_experimental(carveout or None)
        for (model, _, _), event in zip(layers, done):
            torch.cuda.current_stream().wait_event(event)
            x = forward_layer(x, model, options.heads)
        torch._C._set_sm_carveout_experimental(None)
        torch.cuda.current_stream().wait_stream(side)

    runs = [("forward", forward), ("update", update), ("sequential", sequential)]
    times = {name: milliseconds(fn) for name, fn in runs}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {options.layers} layers, "
          f"h {options.hidden}, ffn {options.ffn}, {options.tokens} tokens; forward {times['forward']:.2f} ms, "
          f"update {times['update']:.2f} ms, one after the other {times['sequential']:.2f} ms")
    print("| SMs left to the update | overlapped ms | update hidden |")
    print("|---|---|---|")
    for carveout in [int(value) for value in options.carveouts.split(",")]:
        overlapped_ms = milliseconds(lambda: overlapped(carveout))
        hidden_share = (times["sequential"] - overlapped_ms) / times["update"]
        print(f"| {carveout} | {overlapped_ms:.2f} | {100 * hidden_share:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
