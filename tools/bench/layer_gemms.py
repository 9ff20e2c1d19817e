"""The GEMMs of one GPT layer (and the LM head) on one GPU, each way the training step can run them.

    python tools/bench/layer_gemms.py                       # GPT 1.3B: 8192 tokens, h 2048, ffn 8192
    python tools/bench/layer_gemms.py --tokens 8192 --hidden 768 --ffn 3072 --vocab 50304 --layers 12

For the QKV, projection, FC1, FC2 and LM-head shapes: the forward (with and without the bias epilogue), the
input gradient, and the weight gradient as a bf16 GEMM, as the bf16 x bf16 -> fp32 GEMM that accumulates into
an fp32 main_grad (beta 1, and beta 0 for a step's first writer: fusions/fused_weight_gradient.py), and as a
bf16 GEMM followed by an fp32 addition (what autograd plus DDP's hook would do). ms per call (CUDA events, 30
calls after 3 warm-up calls) and TFLOP/s; last, each variant summed over the layers plus the head: how a
profile's GEMM total splits, and what a different weight-gradient path would save.
"""

import argparse

import torch
import torch.nn.functional as F


def time_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def variants(x, w, b, dy, main_grad):
    return {
        "forward, bias epilogue": lambda: F.linear(x, w, b),
        "forward, no bias": lambda: F.linear(x, w),
        "input gradient": lambda: torch.mm(dy, w),
        "weight gradient, bf16": lambda: torch.mm(dy.t(), x),
        "weight gradient into fp32, beta 1": lambda: torch.addmm(main_grad, dy.t(), x, beta=1.0,
                                                                 out_dtype=torch.float32, out=main_grad),
        "weight gradient into fp32, beta 0": lambda: torch.addmm(main_grad, dy.t(), x, beta=0.0,
                                                                 out_dtype=torch.float32, out=main_grad),
        "weight gradient bf16 + fp32 add": lambda: main_grad.add_(torch.mm(dy.t(), x)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="micro batch x sequence length")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    h = args.hidden
    shapes = {"qkv": (3 * h, h), "proj": (h, h), "fc1": (args.ffn, h), "fc2": (h, args.ffn), "head": (args.vocab, h)}
    rows, per_step = [], {}
    for name, (out_features, in_features) in shapes.items():
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x, dy = torch.randn(args.tokens, in_features, **bf16), torch.randn(args.tokens, out_features, **bf16)
        w, b = torch.randn(out_features, in_features, **bf16) * 0.02, torch.randn(out_features, **bf16)
        main_grad = torch.zeros(out_features, in_features, device="cuda")
        flop = 2 * args.tokens * out_features * in_features
        repeats = 1 if name == "head" else args.layers
        for variant, fn in variants(x, w, b, dy, main_grad).items():
            ms = time_ms(fn)
            rows.append(f"| {name} | {variant} | {ms:.3f} | {flop / ms / 1e9:.0f} |")
            per_step[variant] = per_step.get(variant, 0.0) + ms * repeats
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens, h {h}, ffn {args.ffn}")
    print("| GEMM | variant | ms | TFLOP/s |\n|---|---|---|---|\n" + "\n".join(rows))
    print(f"\n| variant | ms per step ({args.layers} layers + head) |\n|---|---|")
    for variant, ms in per_step.items():
        print(f"| {variant} | {ms:.1f} |")


if __name__ == "__main__":
    main()
