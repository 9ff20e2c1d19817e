"""FSDP against the distributed optimizer on 2 GPUs (NCCL), through pretrain_gpt.py with mock data; one table per
section at the end.

    python tools/bench/fsdp.py                              # both sections (about 20 minutes on 2 x H100)
    python tools/bench/fsdp.py --sections speed             # GPT 1.3B only (about 5 minutes)
    python tools/bench/fsdp.py --sections speed --layouts 0,3,4 --rounds 2   # interleaved twice: ratios per round
    python tools/bench/fsdp.py --sections largest --modes distopt,fsdp       # the model-size ladder, in two
    python tools/bench/fsdp.py --sections largest --modes fsdp-recompute --first-layers 24   # calls

1. speed: GPT 1.3B (24 layers, h 2048, seq 2048, micro batch 4, 2 microbatches per GPU, bf16), 30 iterations,
   in four layouts over DP=2: the distributed optimizer with both overlaps (the reference), --use-torch-fsdp2
   (ZeRO-3), --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads (ZeRO-2 on the distributed
   optimizer's buffers: each backward reduce-scatters bucket by bucket into fp32 gradient shards) and
   optim_grads_params (ZeRO-3 on the same buffers: each rank keeps its bf16 shard of the params, each layer's
   bucket all-gathered before its forward and again before its backward, the next one prefetched). Per
   layout: median tokens/s/GPU of the console lines after the first two, peak memory (max allocated after
   the first iteration, DP rank 0, which holds the larger shards), the speed as a fraction of the
   reference's (target >= 0.90; with --rounds, per round against that round's reference run, and their
   mean), and the largest relative difference of its per-iteration lm loss from the reference's (both start
   from the same weights; bf16 rounding only).
2. largest: Llama-style models (h 4096, 32 heads, 8 KV groups, ffn 14336, SwiGLU, RMSNorm, RoPE, untied,
   no biases, vocab 128256, seq 4096, micro batch 1, global batch 8) with 16, 24, 32, 40, 48, ... layers
   (4.5B, 6.3B, 8.0B, 9.8B, 11.5B, ... parameters), 4 iterations each, climbing until the first run out of
   memory, for: the distributed optimizer (12 bytes per parameter per GPU at DP=2, plus activations), FSDP
   (8 bytes), FSDP with full recompute (8 bytes, one layer's activations). Each mode starts from the size
   where the previous mode stopped fitting, minus one step (`--first-layers` for the first mode). Per mode: the
   largest size that trained, its tokens/s/GPU and peak memory, and the first size that did not fit.

Every run has CUDA_DEVICE_MAX_CONNECTIONS=8 (no tensor parallelism here), so that the collectives' streams run
beside the compute.

A run that fails for another reason than running out of memory stops the script with its output.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parallel_efficiency import communication_per_step  # noqa: E402
from parallel_gpu_check import DP2, GPT_1_3B, MOCK, losses, train  # noqa: E402

BASE = [flag for flag in MOCK if flag != "--use-cpu-initialization"]  # a model built on the GPU, as users do
SPEED = GPT_1_3B + ["--global-batch-size", "16", "--log-interval", "1"]
LAYOUTS = [
    ("distributed optimizer", DP2),
    ("--use-torch-fsdp2", ["--use-torch-fsdp2", "--overlap-grad-reduce"]),
    ("--use-torch-fsdp2, no reshard", ["--use-torch-fsdp2", "--overlap-grad-reduce",
                                        "--torch-fsdp2-no-reshard-after-forward"]),
    ("megatron-fsdp optim_grads", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]),
    ("megatron-fsdp optim_grads_params",
     ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]),
    ("distributed optimizer, compiled", DP2 + ["--use-torch-compile"]),
    ("--use-torch-fsdp2, compiled", ["--use-torch-fsdp2", "--overlap-grad-reduce", "--use-torch-compile"]),
    ("--use-torch-fsdp2, no reshard, compiled", ["--use-torch-fsdp2", "--overlap-grad-reduce",
                                                  "--torch-fsdp2-no-reshard-after-forward", "--use-torch-compile"]),
]
LLAMA = ["--group-query-attention", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16", "--hidden-size", "4096",
         "--num-attention-heads", "32", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
         "--vocab-size", "128256", "--seq-length", "4096", "--max-position-embeddings", "4096",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "1"]
LAYER_STEP, FIRST_LAYERS, LAST_LAYERS = 8, 16, 96
MODES = {
    "distopt": ("distributed optimizer", DP2),
    "fsdp": ("FSDP", ["--use-torch-fsdp2"]),
    "fsdp-recompute": ("FSDP + full recompute", ["--use-torch-fsdp2", "--recompute-granularity", "full",
                                                 "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
}
RUN_TIMEOUT_S = 600
# No tensor parallelism here: several CUDA connections let the collectives' streams run beside the compute (FSDP2
# all-gathers and reduce-scatters on streams of their own; the distributed optimizer's overlapped buckets).
ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}


def llama_parameters(layers: int) -> float:
    """Billions of parameters: per layer attention 2h^2 + 2h.(h/4) (8 of 32 heads for K and V), SwiGLU MLP
    3.h.f, two norms; untied embedding and output 2.V.h; final norm."""
    hidden, ffn, vocab = 4096, 14336, 128256
    layer = 2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * ffn + 2 * hidden
    return (layers * layer + 2 * vocab * hidden + hidden) / 1e9


def median_after_warmup(pattern: str, output: str) -> float:
    values = [float(value) for value in re.findall(pattern, output)]
    return statistics.median(values[2:] or values)


def peak_gib(output: str) -> float:
    return max(float(value) for value in re.findall(r"max allocated: ([0-9.]+)", output)) / 1024


def profile_flags(directory: str, index: int) -> list[str]:
    """Both ranks' `torch.profiler` traces of iterations 20-22 into `directory`/<layout index>/torch_profile; the
    console then prints each rank's kernel summary (ms per step per kernel class, GPU busy fraction)."""
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", "20", "--profile-step-end", "23",
            "--profile-ranks", "0", "1", "--tensorboard-dir", os.path.join(directory, str(index), "tensorboard")]


def speed(layouts: list[int], profile_dir: str | None, rounds: int = 1) -> list[str]:
    """Each layout `rounds` times, interleaved (every layout once, then again): the ratios are taken per round
    against that round's reference run, so that a drift of the machine between runs cancels."""
    runs = {index: [] for index in layouts}  # per round: (tokens/s/GPU, peak GiB, losses)
    for round_index in range(rounds):
        for index in layouts:
            name, flags = LAYOUTS[index]
            profiled = profile_dir if round_index == 0 else None
            if profiled:
                flags = flags + profile_flags(profiled, index)
            output = train(2, SPEED + flags, base=BASE, timeout=RUN_TIMEOUT_S, environment=ENVIRONMENT)
            if profiled:
                print_profile(name, output, os.path.join(profiled, str(index), "torch_profile", "rank-0.json.gz"))
            runs[index].append((median_after_warmup(r"tokens/s/GPU: ([0-9.]+)", output), peak_gib(output),
                                losses(output)))
    reference = runs[layouts[0]]
    rows = [f"{'layout':<34}{'tokens/s/GPU':>13}{'x dist-opt':>11}{'per round':>16}{'peak GiB':>10}"
            f"{'max loss diff':>15}"]
    for index in layouts:
        ratios = [tokens / reference_tokens for (tokens, _, _), (reference_tokens, _, _) in zip(runs[index], reference)]
        worst = max(abs(a - b) / abs(b) for a, b in zip(runs[index][0][2], reference[0][2]))
        rows.append(f"{LAYOUTS[index][0]:<34}{statistics.mean(run[0] for run in runs[index]):>13.0f}"
                    f"{statistics.mean(ratios):>11.3f}{' '.join(f'{ratio:.2f}' for ratio in ratios):>16}"
                    f"{max(run[1] for run in runs[index]):>10.1f}{worst:>15.1e}")
    return rows


def print_profile(name: str, output: str, trace: str) -> None:
    """The console's kernel summaries of a profiled run and, from rank 0's trace, its communication per step."""
    for line in re.findall(r"^profile of iterations.*$", output, flags=re.MULTILINE):
        print(f"{name}: {line}", flush=True)
    if os.path.exists(trace):
        result = communication_per_step(trace, steps=3)
        exposed = ", ".join(f"{kind} {ms:.1f}" for kind, ms in result["exposed by collective"].items())
        print(f"{name}: rank 0 ms/step: communication {result['comm ms/step']:.1f}, exposed "
              f"{result['exposed comm ms/step']:.1f} ({exposed}), GPU idle {result['idle ms/step']:.1f}", flush=True)


def largest(modes: list[str], first_layers: int) -> list[str]:
    rows = [f"{'mode':<24}{'largest that trains':>22}{'tokens/s/GPU':>14}{'peak GiB':>10}{'first out of memory':>22}"]
    layers = first_layers
    for name, flags in (MODES[mode] for mode in modes):
        fitted = None
        while layers <= LAST_LAYERS:
            try:
                output = train(2, LLAMA + flags + ["--num-layers", str(layers)], base=BASE, out_of_memory_ok=True,
                               timeout=RUN_TIMEOUT_S, environment=ENVIRONMENT)
            except subprocess.TimeoutExpired:
                output = None
            if output is None:
                print(f"{name}: {layers} layers do not fit", flush=True)
                break
            fitted = (layers, median_after_warmup(r"tokens/s/GPU: ([0-9.]+)", output), peak_gib(output))
            print(f"{name}: {layers} layers train at {fitted[1]:.0f} tokens/s/GPU, {fitted[2]:.1f} GiB", flush=True)
            layers += LAYER_STEP
        too_large = f"{layers} layers, {llama_parameters(layers):.1f}B" if layers <= LAST_LAYERS else "none tried"
        if fitted is None:
            rows.append(f"{name:<24}{'none':>22}{'':>14}{'':>10}{too_large:>22}")
        else:
            size = f"{fitted[0]} layers, {llama_parameters(fitted[0]):.1f}B"
            rows.append(f"{name:<24}{size:>22}{fitted[1]:>14.0f}{fitted[2]:>10.1f}{too_large:>22}")
        layers = max(FIRST_LAYERS, layers - LAYER_STEP)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="speed,largest", help="comma-separated: speed, largest")
    parser.add_argument("--modes", default=",".join(MODES), help=f"largest: comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--first-layers", type=int, default=FIRST_LAYERS, help="largest: the first size tried")
    parser.add_argument("--layouts", default=",".join(str(index) for index in range(len(LAYOUTS))),
                        help="speed: comma-separated indices into " + "; ".join(
                            f"{index} {name}" for index, (name, _) in enumerate(LAYOUTS)) + " (the first is the "
                        "reference of the ratios)")
    parser.add_argument("--profile", metavar="DIR", help="speed: profile iterations 20-22 of each layout on both "
                        "ranks (in the first round), traces under DIR")
    parser.add_argument("--rounds", type=int, default=1, help="speed: run the layouts this many times, "
                        "interleaved; the ratios are per round")
    options = parser.parse_args()
    sections = options.sections.split(",")
    if "speed" in sections:
        print("\nGPT 1.3B, bf16, seq 2048, micro batch 4 x 2 microbatches per GPU, DP=2:")
        layouts = [int(index) for index in options.layouts.split(",")]
        print("\n".join(speed(layouts, options.profile, options.rounds)), flush=True)
    if "largest" in sections:
        print("\nLlama-style (h 4096, ffn 14336, seq 4096, micro batch 1), 2 GPUs, largest that trains:")
        print("\n".join(largest(options.modes.split(","), options.first_layers)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
