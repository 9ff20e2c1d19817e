"""Tensor / data parallel checks on a multi-GPU machine (NCCL), through pretrain_gpt.py, one table at the end.

    python tools/bench/parallel_gpu_check.py [--skip-throughput] [--long-seq-only]   # needs 2 GPUs

1. Equivalence, fp32, mock data, no dropout, 10 iterations, global batch 8: TP=2 + sequence parallel,
   DP=2 with the distributed optimizer and both overlaps, pipeline parallelism PP=2 (1F1B, and interleaved
   with 2 virtual stages per rank) and context parallelism CP=2 (ring and all-gather attention) must give the per-iteration `lm loss` of one GPU (relative tolerance 1e-4: GPU reductions are
   not bitwise reproducible across layouts). Layer weights are drawn per stage, so a pipeline run does not
   start from one GPU's initial weights: the PP rows and their one-GPU reference all resume from one
   `torch_dist` checkpoint written by one GPU after its first iteration (resharded on load).
2. Throughput, bf16, the benchmark GPT 1.3B shape: one GPU, DP=2 (distributed optimizer, overlaps) and TP=2
   (sequence parallel), tokens/s per GPU and peak memory from the console lines (`--skip-throughput`
   leaves it out).
3. Long sequence, bf16, the 1.3B shape with RoPE at micro-batch 1, 3 iterations a run: the sequence length
   is doubled from 32768 until one GPU runs out of memory, then CP=2 (ring attention, flash-kernel blocks)
   must train that length. Tokens/s per GPU and peak memory of the longest one-GPU run and of the CP=2 run;
   a run still going after LONG_TIMEOUT_S is stopped and counts as a failure, so the usual three runs (fits,
   out of memory, CP=2) take at most 3 x LONG_TIMEOUT_S. `--long-seq-only` runs this section alone.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "2",
        "--eval-interval", "100000", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-4", "--lr-decay-style", "constant", "--use-cpu-initialization"]
# The vocabulary is padded to a multiple of 128 x TP, so a size divisible by 256 keeps TP=1 and TP=2 the same
# model (with --use-cpu-initialization the same weights, too).
SMALL = ["--vocab-size", "50432", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
         "--max-position-embeddings", "512", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "10", "--log-interval", "1", "--use-cpu-initialization"]
GPT_1_3B = ["--vocab-size", "50304", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--micro-batch-size", "4", "--bf16", "--train-iters", "30",
            "--log-interval", "10"]
DP2 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LONG_1_3B = ["--vocab-size", "50304", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--position-embedding-type", "rope", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16",
             "--train-iters", "3", "--log-interval", "1"]
LONG_FIRST, LONG_LAST = 32768, 524288
LONG_TIMEOUT_S = 180


def long_sequence(length: int) -> list[str]:
    return LONG_1_3B + ["--seq-length", str(length), "--max-position-embeddings", str(length)]


def train(gpus: int, args: list[str], out_of_memory_ok: bool = False, timeout: int = 900,
          base: list[str] = MOCK, environment: dict | None = None) -> str | None:
    """The console output of one `pretrain_gpt.py` run with `base` + `args` flags (and `environment` added to
    this process's); None when it ran out of GPU memory and `out_of_memory_ok`. A run still going after
    `timeout` seconds is killed with its workers and raises subprocess.TimeoutExpired."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **(environment or {})}
    process = subprocess.Popen(launcher + [os.path.join(ROOT, "pretrain_gpt.py"), *base, *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # Progress on stderr, so a run cut short by a time limit still shows what finished.
    name = f"{gpus} GPU(s), {' '.join(args[-8:])}"
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers, which hold the GPUs
        process.communicate()
        print(f"{name}: did not finish within {timeout} s", file=sys.stderr, flush=True)
        raise
    if process.returncode != 0:
        if out_of_memory_ok and "out of memory" in (stdout + stderr).lower():
            print(f"{name}: out of memory", file=sys.stderr, flush=True)
            return None
        # torchrun's own summary ends stderr; the workers' errors can lie far above it.
        raise SystemExit(stdout[-3000:] + stderr[-3000:] + "\n" + WORKERS_RAISED + "\n".join(
            worker_errors(stdout + "\n" + stderr)[:6]))
    print(f"{name}: lm loss {losses(stdout)[-1:]}", file=sys.stderr, flush=True)
    return stdout


WORKERS_RAISED = "workers raised:\n"


def worker_errors(output: str) -> list[str]:
    """The errors a run's workers printed: exception lines (`...Error: message`, "[rankN]: " prefix dropped) and
    the argument problems ("error: N problem(s) ..." and its "  - " lines); not torchrun's ChildFailedError."""
    found, in_problems = [], False
    for line in output.splitlines():
        line = re.sub(r"^\[rank\d+\]: ", "", line)
        if in_problems and line.startswith("  - "):
            found.append(line.strip())
            continue
        in_problems = line.startswith("error: ")
        if in_problems or (re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line):
            found.append(line.strip())
    return found


def losses(output: str) -> list[float]:
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", output)]


def last(pattern: str, output: str) -> float:
    return float(re.findall(pattern, output)[-1])


def equivalence(workdir: str) -> tuple[list[str], bool]:
    """One row per layout: its per-iteration losses against one GPU's from the same starting weights."""
    start = os.path.join(workdir, "start")
    train(1, SMALL + ["--train-iters", "1", "--save", start, "--save-interval", "1", "--ckpt-format", "torch_dist"])
    resume = ["--load", start, "--ckpt-format", "torch_dist", "--no-load-rng",
              "--override-opt-param-scheduler", "--train-iters", "11"]
    references = {"init": losses(train(1, SMALL)), "resume": losses(train(1, SMALL + resume))}
    rows, ok = [], True
    for name, gpus, extra, start_from in [
            ("TP=2 + SP", 2, TP2, "init"), ("DP=2 dist-opt overlap", 2, DP2, "init"),
            ("PP=2 1F1B", 2, PP2 + resume, "resume"),
            ("PP=2 interleaved x2", 2, PP2 + resume + ["--num-layers-per-virtual-pipeline-stage", "1"], "resume"),
            ("CP=2 ring", 2, CP2, "init"), ("CP=2 all-gather", 2, CP2 + ["--cp-comm-type", "allgather"], "init")]:
        reference = references[start_from]
        got = losses(train(gpus, SMALL + extra))
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
        ok &= len(got) == len(reference) and worst <= 1e-4
        rows.append(f"{name:<24} iterations {len(got):>2}  max rel diff vs 1 GPU {worst:.2e}")
    return rows, ok


def trained(output: str) -> str:
    """Iterations, last loss, tokens/s/GPU and peak memory of a run's console output."""
    return (f"{len(losses(output))} iterations, lm loss {losses(output)[-1]:.3f}, "
            f"{last(r'tokens/s/GPU: ([0-9.]+)', output):.0f} tokens/s/GPU, "
            f"peak {last(r'max allocated: ([0-9.]+)', output):.0f} MB")


def long_sequences() -> tuple[list[str], bool]:
    """Section 3's rows, and whether CP=2 trained a length that one GPU cannot."""
    rows, length = [], LONG_FIRST
    try:
        while length <= LONG_LAST:
            output = train(1, long_sequence(length), out_of_memory_ok=True, timeout=LONG_TIMEOUT_S)
            if output is None:
                rows.append(f"one GPU, seq {length}: out of memory")
                break
            rows.append(f"one GPU, seq {length}: {trained(output)}")
            length *= 2
        else:
            return rows + [f"one GPU fits every length up to {LONG_LAST}: no out-of-memory length to try"], False
        output = train(2, long_sequence(length) + CP2, out_of_memory_ok=True, timeout=LONG_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        layout = "CP=2 (ring)" if "--context-parallel-size" in timeout.cmd else "one GPU"
        return rows + [f"{layout}, seq {length}: not done within {LONG_TIMEOUT_S} s"], False
    return rows + [f"CP=2 (ring), seq {length}: " + ("out of memory" if output is None else trained(output))], (
        output is not None)


def main() -> int:
    skip_throughput = "--skip-throughput" in sys.argv[1:]
    long_only = "--long-seq-only" in sys.argv[1:]
    rows, ok = [], True
    if not long_only:
        with tempfile.TemporaryDirectory() as workdir:
            rows, ok = equivalence(workdir)

    throughput = []
    for name, gpus, extra in [] if skip_throughput or long_only else [
            ("1 GPU", 1, ["--global-batch-size", "4"]),
            ("DP=2 dist-opt overlap", 2, DP2 + ["--global-batch-size", "8"]),
            ("TP=2 + SP", 2, TP2 + ["--global-batch-size", "4"])]:
        output = train(gpus, GPT_1_3B + extra)
        tokens = last(r"tokens/s/GPU: ([0-9.]+)", output)
        memory = last(r"max allocated: ([0-9.]+)", output)
        throughput.append((name, gpus, tokens, memory))

    long_rows, long_ok = long_sequences()

    if rows:
        print("\nequivalence (fp32, 10 iterations, lm loss per iteration vs one GPU):")
        print("\n".join(rows))
        print(f"equivalence {'PASSED' if ok else 'FAILED'} (tolerance 1e-4 relative)")
    if throughput:
        base = throughput[0][2]
        print("\nGPT 1.3B, bf16, seq 2048, micro batch 4:")
        print(f"{'layout':<24}{'GPUs':>5}{'tokens/s/GPU':>14}{'x 1 GPU (total)':>17}{'peak MB':>10}")
        for name, gpus, tokens, memory in throughput:
            print(f"{name:<24}{gpus:>5}{tokens:>14.0f}{tokens * gpus / base:>17.2f}{memory:>10.0f}")
    print("\nlong sequence, GPT 1.3B + RoPE, bf16, micro batch 1:")
    print("\n".join(long_rows))
    print(f"long sequence {'PASSED' if long_ok else 'FAILED'}")
    return 0 if ok and long_ok else 1


if __name__ == "__main__":
    sys.exit(main())
