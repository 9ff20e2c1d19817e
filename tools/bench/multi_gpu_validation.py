"""The multi-GPU validation run: 3D-parallel GPT 1.3B against pure data parallelism, a Llama-style 8B through
the interleaved pipeline in bf16 and FP8 with a resharded reload, a Mixtral-style MoE under expert
parallelism and CP=4 at 32k tokens; one table at the end, every run through `pretrain_gpt.py` with mock data.

    bash examples/validation/run_8gpu.sh                          # this script on every GPU of the host
    python tools/bench/multi_gpu_validation.py --gpus 4           # where an 8-GPU host is not available
    python tools/bench/multi_gpu_validation.py --gpus 4 --tiny    # the same runs, tiny shapes, on the CPU

Layouts (on 4 GPUs every data-parallel size is halved, the Llama pipeline keeps PP=2 with TP=2, and the
reload goes to TP=4 x PP=1):

| run | 8 GPUs | 4 GPUs |
|---|---|---|
| GPT 1.3B, 3D | TP=2 x PP=2 x DP=2, SP, distributed optimizer, both overlaps | TP=2 x PP=2 x DP=1 |
| GPT 1.3B, reference | DP=8, distributed optimizer, both overlaps | DP=4 |
| GPT 1.3B, scaling base | 1 GPU | 1 GPU |
| Llama 8B, bf16 and FP8 (hybrid, delayed) | TP=4 x PP=2 interleaved (2 virtual stages), SP | TP=2 x PP=2 interleaved |
| Llama 8B reload of the bf16 run's torch_dist checkpoint | TP=2 x PP=4 | TP=4 x PP=1 |
| Mixtral-style MoE (8 experts, top-2, alltoall) | EP=8; EP=4 x TP=2 | EP=4; EP=2 x TP=2 |
| GPT 1.3B + RoPE, seq 32768, micro batch 1 | CP=4 x DP=2 | CP=4 |

Loss match: the one-GPU run trains 11 iterations and writes a torch_dist checkpoint (weights only), which the
3D run and the DP reference both load (resharded), so they start from the same weights (pipeline stages
draw their initial weights from per-stage seeds, so fresh runs of two layouts do not); both then train the
same 100 iterations of the same global batch. bf16 runs of two layouts differ by rounding (other GEMM
splits and reduction orders), so the check is `--loss-rtol` (default 2e-2) on every iteration's lm loss,
relative to the reference loss or to 1 where that is smaller, with the largest difference and both curves
printed; the fp32 equivalence at 1e-4 is tools/bench/parallel_gpu_check.py's.

Reload: the Llama bf16 run saves at iteration 3 (weights only: 16 GB instead of 144 GB with the optimizer),
trains on to 5 (and saves again); the reload run starts from the iteration-3 checkpoint (`--ckpt-step 3`) in
another layout, so its iteration-4
loss is computed from the same weights on the same batch as the saving run's and must match (same tolerance).

Reported per run: median tokens/s/GPU, TFLOP/s/GPU and MFU of the console lines after the first two
(warm-up), peak memory (`max allocated` of the first memory report, the largest over the ranks that print
it) and, for MoE, the load-balancing loss without its coefficient (E * sum_i f_i * P_i: 1.0 for uniform
routing). Data-parallel scaling efficiency = tokens/s/GPU of DP=N / tokens/s/GPU of one GPU, both with 4
micro batches of 4 per GPU and iteration (weak scaling: the same work per GPU; with one micro batch per GPU,
4 x H100 gave 86%, the gradient reduce-scatter and the parameter all-gather then being due every 4 x 2048
tokens). A run that fails or outlives --timeout is a failed row and the rest go on. On 4 H100s the four
sections take over 10 minutes together; `--sections gpt,llama` and `--sections moe,cp` split them.
"""

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parallel_gpu_check import DP2, GPT_1_3B, MOCK, ROOT, long_sequence, losses, train  # noqa: E402

BASE = [flag for flag in MOCK if flag != "--use-cpu-initialization"]
LOG = ["--log-interval", "1"]
LLAMA_ARCH = ["--group-query-attention", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
              "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16"]
LLAMA_8B = LLAMA_ARCH + ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                         "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--vocab-size", "128256",
                         "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
                         "--global-batch-size", "8"]
MIXTRAL = LLAMA_ARCH + ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
                        "--num-query-groups", "8", "--ffn-hidden-size", "5632", "--vocab-size", "32000",
                        "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "2",
                        "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
                        "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss"]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]
# --tiny: each shape's flags replaced (argparse keeps a flag's last value) so the same runs fit a CPU.
TINY = {
    "gpt": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--vocab-size", "1024", "--micro-batch-size", "2"],
    "llama": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "4",
              "--ffn-hidden-size", "128", "--vocab-size", "1024", "--seq-length", "128",
              "--max-position-embeddings", "128"],
    "long": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "1024",
             "--seq-length", "256", "--max-position-embeddings", "256"],
}


class Runner:
    """Runs the layouts, keeps one result row per run and says whether every check passed."""

    def __init__(self, gpus: int, tiny: bool, timeout: int, loss_rtol: float):
        self.gpus, self.tiny, self.timeout, self.loss_rtol = gpus, tiny, timeout, loss_rtol
        self.rows: list[dict] = []
        self.ok = True

    def run(self, section: str, layout: str, gpus: int, args: list[str], shape: str) -> str | None:
        args = args + (TINY[shape] if self.tiny else [])
        try:
            output = train(gpus, args, timeout=self.timeout, base=BASE)
        except (SystemExit, subprocess.TimeoutExpired) as failure:
            print(f"{section} {layout}: FAILED\n{str(failure)[-3000:]}", file=sys.stderr, flush=True)
            self.rows.append({"section": section, "layout": layout, "gpus": gpus, "check": "run FAILED"})
            self.ok = False
            return None
        self.rows.append({"section": section, "layout": layout, "gpus": gpus, **measured(output)})
        print(f"{section} {layout}: {self.rows[-1]}", file=sys.stderr, flush=True)  # kept if the table is not reached
        return output

    def mark(self, text: str, passed: bool | None = None, binding: bool = True) -> None:
        """Puts `text` (and PASSED / FAILED where `passed` is given) in the last row's check column and prints
        it; a failed `binding` check fails the validation."""
        if passed is not None:
            text += " PASSED" if passed else " FAILED"
            self.ok &= passed or not binding
        self.rows[-1]["check"] = text
        print(text, file=sys.stderr, flush=True)

    def check(self, label: str, got: list[float], reference: list[float]) -> None:
        """Marks the last row with the largest lm-loss difference from `reference`, relative to the reference
        loss or to 1 where the loss is below 1 (mock data is learnt down to ~0.01, where a relative
        difference says nothing); prints both curves, which the table leaves out."""
        worst = max((abs(a - b) / max(abs(b), 1.0) for a, b in zip(got, reference)), default=float("inf"))
        self.mark(f"{label}: {len(got)} iterations, max diff {worst:.1e}",
                  len(got) == len(reference) > 0 and worst <= self.loss_rtol)
        print(f"  got       {got}\n  reference {reference}", file=sys.stderr, flush=True)


def median_after_warmup(pattern: str, output: str) -> float | None:
    values = [float(v) for v in re.findall(pattern, output)]
    return statistics.median(values[2:] or values) if values else None


def measured(output: str) -> dict:
    peaks = [float(v) for v in re.findall(r"max allocated: ([0-9.]+)", output)]
    balance = re.findall(r"\| load_balancing_loss: ([0-9.E+-]+) \|", output)
    curve = losses(output)
    return {
        "iterations": len(curve),
        "lm loss": curve[-1] if curve else None,
        "tokens/s/GPU": median_after_warmup(r"tokens/s/GPU: ([0-9.]+)", output),
        "TFLOP/s/GPU": median_after_warmup(r"TFLOP/s/GPU\): ([0-9.]+)", output),
        "MFU %": median_after_warmup(r"MFU: ([0-9.]+)%", output),
        "peak GB": max(peaks) / 1024 if peaks else None,
        "balance": float(balance[-1]) if balance else None,
    }


def losses_by_iteration(output: str) -> dict[int, float]:
    found = re.findall(r"iteration\s+(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", output)
    return {int(iteration): float(loss) for iteration, loss in found}


def gpt_3d(runner: Runner, workdir: str) -> None:
    """3D parallel against DP=N from one checkpoint, and data-parallel scaling from one GPU."""
    n = runner.gpus
    start = os.path.join(workdir, "gpt_start")
    gpt = GPT_1_3B + LOG + ["--micro-batch-size", "4"]
    overlap = DP2  # the distributed optimizer with both overlaps
    runner.run("GPT 1.3B", "1 GPU (scaling base; writes the start checkpoint)", 1,
               gpt + ["--global-batch-size", "16", "--train-iters", "11", "--save", start, "--save-interval", "11",
                      "--ckpt-format", "torch_dist", "--no-save-optim"], "gpt")
    base = runner.rows[-1].get("tokens/s/GPU")
    resume = ["--load", start, "--ckpt-format", "torch_dist", "--no-load-optim", "--no-load-rng",
              "--override-opt-param-scheduler", "--train-iters", "111", "--global-batch-size", str(16 * n)]
    reference = runner.run("GPT 1.3B", f"DP={n}, dist-opt, overlaps", n, gpt + overlap + resume, "gpt")
    scaled = runner.rows[-1].get("tokens/s/GPU")
    if base and scaled:
        # CPU processes share cores (--tiny): no scaling to expect there.
        runner.mark(f"DP scaling 1 -> {n} GPUs: {100 * scaled / base:.1f}%", scaled / base >= 0.9, not runner.tiny)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    got = runner.run("GPT 1.3B", f"TP=2 x PP=2 x DP={n // 4}, SP, dist-opt, overlaps", n,
                     gpt + overlap + layout + resume, "gpt")
    if reference is not None and got is not None:
        runner.check(f"vs DP={n}", losses(got), losses(reference))


def llama(runner: Runner, workdir: str) -> None:
    """The interleaved pipeline in bf16 (saving) and FP8, then the reload in another layout."""
    n = runner.gpus
    tp, reload_tp, reload_pp = (4, 2, 4) if n >= 8 else (2, 4, 1)
    save = os.path.join(workdir, "llama")
    layers_per_virtual_stage = "1" if runner.tiny else "8"
    layout = ["--tensor-model-parallel-size", str(tp), "--sequence-parallel", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", layers_per_virtual_stage]
    name = f"TP={tp} x PP=2 interleaved x2"
    saved = runner.run("Llama 8B", f"{name}, bf16 (saves at 3)", 2 * tp,
                       LLAMA_8B + LOG + layout + ["--train-iters", "5", "--save", save, "--save-interval", "3",
                                                  "--ckpt-format", "torch_dist", "--no-save-optim"], "llama")
    bf16 = runner.rows[-1].get("tokens/s/GPU")
    runner.run("Llama 8B", f"{name}, FP8 hybrid delayed", 2 * tp,
               LLAMA_8B + LOG + layout + FP8 + ["--train-iters", "5"], "llama")
    fp8 = runner.rows[-1].get("tokens/s/GPU")
    if bf16 and fp8:
        runner.mark(f"FP8 / bf16 tokens/s: {fp8 / bf16:.2f}x")
    reload_layout = ["--tensor-model-parallel-size", str(reload_tp), "--pipeline-model-parallel-size", str(reload_pp)]
    reload_layout += ["--sequence-parallel"] if reload_tp > 1 else []
    reloaded = runner.run("Llama 8B", f"reload at TP={reload_tp} x PP={reload_pp}", reload_tp * reload_pp,
                          LLAMA_8B + LOG + reload_layout + ["--train-iters", "4", "--load", save, "--ckpt-step", "3",
                                                            "--ckpt-format", "torch_dist", "--no-load-optim",
                                                            "--no-load-rng"], "llama")
    if saved is not None and reloaded is not None:
        runner.check("iteration-4 loss vs saving run", [losses_by_iteration(reloaded).get(4, float("inf"))],
                     [losses_by_iteration(saved).get(4, float("nan"))])


def moe(runner: Runner) -> None:
    n = runner.gpus
    for layout, flags in [(f"EP={n}", ["--expert-model-parallel-size", str(n)]),
                          (f"EP={n // 2} x TP=2", ["--expert-model-parallel-size", str(n // 2),
                                                   "--tensor-model-parallel-size", "2", "--sequence-parallel"])]:
        data_parallel = n // (2 if "TP" in layout else 1)
        runner.run("Mixtral-style MoE", layout, n,
                   MIXTRAL + LOG + flags + ["--global-batch-size", str(2 * data_parallel), "--train-iters", "10"],
                   "llama")


def long_context(runner: Runner) -> None:
    n = runner.gpus
    runner.run("GPT 1.3B + RoPE, seq 32768", f"CP=4 x DP={n // 4}", n,
               long_sequence(32768) + ["--context-parallel-size", "4", "--global-batch-size", str(n // 4),
                                       "--train-iters", "5"], "long")


def table(rows: list[dict]) -> str:
    columns = ["section", "layout", "gpus", "iterations", "lm loss", "tokens/s/GPU", "TFLOP/s/GPU", "MFU %",
               "peak GB", "balance", "check"]
    formats = {"lm loss": "{:.4f}", "tokens/s/GPU": "{:.0f}", "TFLOP/s/GPU": "{:.1f}", "MFU %": "{:.1f}",
               "peak GB": "{:.1f}", "balance": "{:.3f}"}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row.get(column) for column in columns]
        lines.append("| " + " | ".join("" if cell is None else formats.get(column, "{}").format(cell)
                                       for column, cell in zip(columns, cells)) + " |")
    return "\n".join(lines)


def machine() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, check=True).stdout.split("\n")
        names = [name for name in names if name]
        return f"{len(names)} x {names[0]}"
    except (OSError, subprocess.CalledProcessError):
        return "CPU (gloo)"


def commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=8, choices=[4, 8])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, gloo): checks the script itself")
    parser.add_argument("--sections", default="gpt,llama,moe,cp", help="comma-separated subset of gpt,llama,moe,cp")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one run may take")
    parser.add_argument("--loss-rtol", type=float, default=2e-2)
    parser.add_argument("--commit", default=None, help="commit to print (default: git rev-parse HEAD)")
    parser.add_argument("--workdir", default=None, help="checkpoints (default: a temporary directory)")
    args = parser.parse_args()

    runner = Runner(args.gpus, args.tiny, args.timeout, args.loss_rtol)
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        if "gpt" in sections:
            gpt_3d(runner, workdir)
        if "llama" in sections:
            llama(runner, workdir)
        if "moe" in sections:
            moe(runner)
        if "cp" in sections:
            long_context(runner)
    print(f"\n{datetime.date.today()}, commit {args.commit or commit()}, {machine()}"
          f"{', tiny shapes' if args.tiny else ''}, `{' '.join(sys.argv)}`")
    print(table(runner.rows))
    print(f"validation {'PASSED' if runner.ok else 'FAILED'}")
    return 0 if runner.ok else 1


if __name__ == "__main__":
    sys.exit(main())
