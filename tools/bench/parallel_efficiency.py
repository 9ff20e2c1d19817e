"""Parallel efficiency on the two GPUs of one host: every layout of the GPT 1.3B against one GPU, one table.

    python tools/bench/parallel_efficiency.py                         # 2 GPUs, ~8 minutes
    python tools/bench/parallel_efficiency.py --extra mbs8,graph,cp,ep,8b   # + more rows (each pair ~1-4 min)
    python tools/bench/parallel_efficiency.py --sections tp,dp        # a part of the main rows (also: pp)
    python tools/bench/parallel_efficiency.py --tiny                  # the script itself: tiny, CPU, gloo

First tools/bench/tp_overlap_check.py (the sequence-parallel MLP per --tp-comm-overlap implementation), then
`pretrain_gpt.py` runs of the GPT 1.3B (24 layers, h 2048, 16 heads, seq 2048, vocab 50304, bf16, mock data,
micro batch 4), each giving ms/iteration and tokens/s/GPU (median of the log intervals after the first, the
profiled iterations left out) and peak memory (`max allocated`, the largest over the ranks):

| row | GPUs | global batch | % of ideal |
|---|---|---|---|
| one GPU | 1 | 4 | reference of the TP and DP rows |
| one GPU, 8 micro batches | 1 | 32 | reference of the PP rows |
| TP=2 + SP | 2 | 4 | tokens/s/GPU over one GPU's |
| TP=2 + SP + --tp-comm-overlap (symmetric memory where the GPUs allow it) | 2 | 4 | same |
| TP=2 + SP + --tp-comm-overlap, chunked (MEGATRON_TP_COMM_OVERLAP_IMPL=chunked) | 2 | 4 | same |
| TP=2, no SP | 2 | 4 | same |
| DP=2, distributed optimizer, both overlaps (also with CUDA_DEVICE_MAX_CONNECTIONS=8) | 2 | 8 | same |
| PP=2 1F1B, 8 micro batches | 2 | 32 | ideal step / step, ideal = one GPU's step / 2 x (m + p - 1) / m |
| PP=2 interleaved, 2 virtual stages | 2 | 32 | same ideal (the interleaved bubble is smaller: above 100% is possible) |

--extra adds: mbs8 (TP=2 + SP with and without the overlap at micro batch 8: what a micro batch costs beyond its
tokens), graph (one GPU, TP=2 + SP (also with the overlap, symmetric memory and chunked) and TP=2 with
`--cuda-graph-impl full_iteration`, against the one-GPU graph row: what remains when the host no longer launches
each kernel), cp (GPT 1.3B shape + RoPE with 12 layers, so that one GPU fits seq 32768: CP=2 with the distributed
optimizer and both overlaps, ring with 1 and 8 CUDA connections and all-gather, against one GPU; cp-ring: the
reference and the ring row only), ep
(Mixtral-style MoE with 8 layers: EP=2 x DP=2 against EP=1 on one GPU, the same tokens per GPU), 8b (Llama-style
8B at TP=2 + SP with bf16 Adam moments to fit 2 x 80 GB, eager, graphed and graphed with the overlap, against TP=1
of the same layer shapes with 4 layers: TFLOP/s/GPU, since the layer counts differ), nccl (the DP=2 row with the
data-parallel groups' NCCL kernels capped at 8 CTAs, `--nccl-communicator-config-path`, and on high-priority
streams, `--high-priority-stream-groups dp dp_cp`), dp-bf16 (the DP=2 row with `--grad-reduce-in-bf16`: the
gradients reduce-scattered in bf16, half the bytes of the exposed last bucket).

The two-GPU rows also profile two iterations (`--profile --use-pytorch-profiler`): the per-rank kernel summary
of the console, and from rank 0's trace the communication kernel time per step (NCCL kernels, peer-to-peer
copies, symmetric-memory barriers) and the part of it during which no compute kernel ran (exposed). A
communication kernel counts from its launch, so the time it waits for the other GPU is in it: for PP that is
the pipeline bubble. Rank 0's trace of each row is kept in --trace-dir (7 files). The table prints last; each
run's row goes to stderr as it ends.
"""

import argparse
import datetime
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_sources import load_events  # noqa: E402
from multi_gpu_validation import LLAMA_8B, MIXTRAL, commit, machine  # noqa: E402
from parallel_gpu_check import DP2, MOCK, ROOT, WORKERS_RAISED, losses, train, worker_errors  # noqa: E402

BASE = [flag for flag in MOCK if flag != "--use-cpu-initialization"]
GPT_1_3B = ["--vocab-size", "50304", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "4", "--bf16"]
TINY = ["--vocab-size", "1024", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "128",
        "--max-position-embeddings", "128"]  # each row keeps its micro and global batch
TP2 = ["--tensor-model-parallel-size", "2"]
SP = ["--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
INTERVAL = 5
COMMUNICATION = ("nccl", "ptop", "barrier", "symm_mem", "put_signal", "wait_signal")


def iterations(count: int, profile: bool) -> list[str]:
    """`count` iterations logged every INTERVAL; with `profile`, two more iterations under the profiler (their
    interval is not measured)."""
    flags = ["--train-iters", str(count + (INTERVAL if profile else 0)), "--log-interval", str(INTERVAL)]
    if profile:
        flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(count + 1),
                  "--profile-step-end", str(count + 3)]
    return flags


def measured(output: str, profiled_from: int | None) -> dict:
    """Median ms/iteration and tokens/s/GPU and TFLOP/s/GPU of the intervals after the first (and before a
    profiled one), peak MB, last lm loss."""
    found = re.findall(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+) \| tokens/s/GPU: "
                       r"([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)", output)
    kept = [row for row in found[1:] if profiled_from is None or int(row[0]) < profiled_from] or found
    peaks = [float(value) for value in re.findall(r"max allocated: ([0-9.]+)", output)]
    curve = losses(output)
    return {
        "ms": statistics.median(float(row[1]) for row in kept) if kept else None,
        "tokens/s/GPU": statistics.median(float(row[2]) for row in kept) if kept else None,
        "TFLOP/s/GPU": statistics.median(float(row[3]) for row in kept) if kept else None,
        "peak MB": max(peaks) if peaks else None,
        "lm loss": curve[-1] if curve else None,
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _collective(name: str) -> str:
    """The kind of a communication kernel: AllGather, ReduceScatter, ... of NCCL's kernel names, else its name."""
    found = re.search(r"ncclDevKernel_([A-Za-z]+)", name)
    return found.group(1) if found else name.split("(")[0][:24].strip()


def communication_per_step(trace_path: str, steps: int) -> dict:
    """ms per step of communication kernels, of the part of them with no compute kernel running (exposed; also
    by collective), and of the GPU idle with neither running (host-bound gaps), from a Chrome trace of
    torch.profiler (GPU events: "kernel" and "gpu_memcpy" categories)."""
    by_kind, compute = {}, []
    for event in load_events(trace_path):
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", "gpu_memcpy"):
            continue
        interval = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0)))
        name = event.get("name", "")
        if any(part in name.lower() for part in COMMUNICATION):
            by_kind.setdefault(_collective(name), []).append(interval)
        elif event["cat"] == "kernel":
            compute.append(interval)
    communication = _union([interval for intervals in by_kind.values() for interval in intervals])
    compute = _union(compute)
    everything = _union(communication + compute)
    total = _length(communication)
    exposed = {kind: _length(_union(intervals)) - _intersection(_union(intervals), compute)
               for kind, intervals in by_kind.items()}
    span = everything[-1][1] - everything[0][0] if everything else 0.0
    return {"comm ms/step": total / 1e3 / steps,
            "exposed comm ms/step": (total - _intersection(communication, compute)) / 1e3 / steps,
            "exposed by collective": {kind: ms / 1e3 / steps for kind, ms in exposed.items()},
            "idle ms/step": (span - _length(everything)) / 1e3 / steps}


def failure_reason(output: str) -> str:
    """What the workers of a failed run raised (torchrun's own ChildFailedError says nothing), else the
    output's tail."""
    listed = output.split(WORKERS_RAISED)[1].splitlines() if WORKERS_RAISED in output else []  # train()'s list
    errors = [line for line in listed if line] or worker_errors(output)
    return ("; ".join(errors[:3]) if errors else output[-300:]).strip()[:400]


class Bench:
    def __init__(self, tiny: bool, timeout: int, trace_dir: str):
        self.tiny, self.timeout, self.trace_dir = tiny, timeout, trace_dir
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def run(self, name: str, gpus: int, flags: list[str], count: int = 15, profile: bool = False,
            environment: dict | None = None) -> dict:
        """One pretrain_gpt.py run; its row (also printed to stderr)."""
        args = flags + (TINY if self.tiny else []) + iterations(count, profile)
        try:
            output = train(gpus, args, timeout=self.timeout, base=BASE, environment=environment)
        except (SystemExit, subprocess.TimeoutExpired) as failure:
            row = {"row": name, "gpus": gpus, "note": f"FAILED: {failure_reason(str(failure))}"}
            output = None
        if output is not None:
            row = {"row": name, "gpus": gpus, **measured(output, count + 1 if profile else None)}
            if profile:
                row.update(self.profile(name, output))
        self.rows.append(row)
        print(f"{name}: {row}", file=sys.stderr, flush=True)
        return row

    def profile(self, name: str, output: str) -> dict:
        """The kernel summaries of the console and the communication of rank 0's trace; the trace is moved to
        --trace-dir (the profiler writes <ROOT>/torch_profile/rank-N.*)."""
        self.notes += [f"{name}: {line}" for line in re.findall(r"profile of iterations [^;\n]*", output)]
        directory = os.path.join(ROOT, "torch_profile")
        traces = sorted(glob.glob(os.path.join(directory, "rank-0.json*")))
        result = communication_per_step(traces[0], steps=2) if traces else {}
        if traces:
            os.makedirs(self.trace_dir, exist_ok=True)
            slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
            shutil.move(traces[0], os.path.join(self.trace_dir, f"{slug}.rank0.json.gz"))
        shutil.rmtree(directory, ignore_errors=True)
        return result

    def ratio(self, row: dict, reference: dict, key: str = "tokens/s/GPU") -> None:
        """row["% of ideal"] = row[key] / reference[key]."""
        if row.get(key) and reference.get(key):
            row["% of ideal"] = 100 * row[key] / reference[key]


def gpt_rows(bench: Bench, sections: list[str]) -> dict:
    """The main rows of `sections` (tp, dp, pp); returns the one-GPU reference row of the TP and DP rows."""
    gpt = GPT_1_3B
    one = {}
    if "tp" in sections or "dp" in sections:
        one = bench.run("one GPU, global batch 4", 1, gpt + ["--global-batch-size", "4"], count=20)
    tp_rows = [
        ("TP=2 + SP", TP2 + SP, None),
        ("TP=2 + SP + tp-comm-overlap", TP2 + SP + ["--tp-comm-overlap"], None),
        ("TP=2 + SP + tp-comm-overlap (chunked)", TP2 + SP + ["--tp-comm-overlap"],
         {"MEGATRON_TP_COMM_OVERLAP_IMPL": "chunked"}),
        ("TP=2, no SP", TP2, None),
    ]
    for name, flags, environment in tp_rows if "tp" in sections else []:
        bench.ratio(bench.run(name, 2, gpt + flags + ["--global-batch-size", "4"], count=20, profile=True,
                              environment=environment), one)
    if "dp" in sections:
        # Every run gets CUDA_DEVICE_MAX_CONNECTIONS=1 (what TP's overlaps need, and Megatron-LM's scripts set);
        # without TP nothing needs it, and one hardware queue can hold a collective behind queued compute.
        eight = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
        for name, environment in (("DP=2, dist-opt, both overlaps", None),
                                  ("DP=2, dist-opt, both overlaps, 8 connections", eight)):
            bench.ratio(bench.run(name, 2, gpt + DP2 + ["--global-batch-size", "8"], count=20, profile=True,
                                  environment=environment), one)
    if "pp" not in sections:
        return one
    one_pp = bench.run("one GPU, global batch 32 (8 micro batches)", 1, gpt + ["--global-batch-size", "32"])
    micro_batches, stages = 8, 2
    for name, flags in [("PP=2 1F1B, 8 micro batches", PP2),
                        ("PP=2 interleaved x2, 8 micro batches", PP2 + ["--num-layers-per-virtual-pipeline-stage",
                                                                        "1" if bench.tiny else "6"])]:
        row = bench.run(name, 2, gpt + flags + ["--global-batch-size", "32"], profile=True)
        if row.get("ms") and one_pp.get("ms"):
            ideal = one_pp["ms"] / stages * (micro_batches + stages - 1) / micro_batches
            row["% of ideal"] = 100 * ideal / row["ms"]
            row["note"] = f"ideal {ideal:.1f} ms = one GPU {one_pp['ms']:.1f} / 2 x 9/8"
    return one


def extra_rows(bench: Bench, extras: list[str], one: dict) -> None:
    if "mbs8" in extras:  # the per-micro-batch fixed cost: how the time grows with the micro batch
        one = one or bench.run("one GPU, global batch 4", 1, GPT_1_3B + ["--global-batch-size", "4"], count=20)
        bench.ratio(bench.run("TP=2 + SP, micro batch 8", 2, GPT_1_3B + TP2 + SP + [
            "--micro-batch-size", "8", "--global-batch-size", "8"], count=20), one)
        bench.ratio(bench.run("TP=2 + SP + tp-comm-overlap, micro batch 8", 2, GPT_1_3B + TP2 + SP + [
            "--tp-comm-overlap", "--micro-batch-size", "8", "--global-batch-size", "8"], count=20), one)
    if "graph" in extras:  # the host's share: the same rows replayed from a full-iteration CUDA graph
        graph = ["--cuda-graph-impl", "full_iteration", "--global-batch-size", "4"]
        one = bench.run("one GPU, CUDA graph", 1, GPT_1_3B + graph, count=20)
        chunked = {"MEGATRON_TP_COMM_OVERLAP_IMPL": "chunked"}
        for name, flags, environment in [
                ("TP=2 + SP, CUDA graph", TP2 + SP, None),
                ("TP=2 + SP + tp-comm-overlap, CUDA graph", TP2 + SP + ["--tp-comm-overlap"], None),
                ("TP=2 + SP + tp-comm-overlap (chunked), CUDA graph", TP2 + SP + ["--tp-comm-overlap"], chunked),
                ("TP=2, no SP, CUDA graph", TP2, None)]:
            bench.ratio(bench.run(name, 2, GPT_1_3B + flags + graph, count=20, profile=True, environment=environment),
                        one)
    if "cp" in extras or "cp-ring" in extras:  # cp-ring: the reference and the ring row only
        long = GPT_1_3B + ["--num-layers", "12", "--position-embedding-type", "rope", "--seq-length", "32768",
                           "--max-position-embeddings", "32768", "--micro-batch-size", "1", "--global-batch-size", "1"]
        one = bench.run("CP ref: one GPU, 12 layers, seq 32768", 1, long, count=10)
        # The gradients are reduced over the CP ranks: overlapped with backward, as Megatron-LM's CP recipes run.
        cp = long + ["--context-parallel-size", "2"] + DP2
        bench.ratio(bench.run("CP=2 ring, seq 32768", 2, cp, count=15, profile=True), one)
    if "cp" in extras:
        bench.ratio(bench.run("CP=2 ring, seq 32768, 8 connections", 2, cp, count=15, profile=True,
                              environment={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}), one)
        bench.ratio(bench.run("CP=2 all-gather, seq 32768", 2, cp + ["--cp-comm-type", "allgather"], count=15,
                              profile=True), one)
    if "ep" in extras:
        moe = MIXTRAL + ["--num-layers", "8"]
        one = bench.run("EP ref: MoE 8 layers, EP=1, one GPU", 1, moe + ["--global-batch-size", "2"], count=10)
        bench.ratio(bench.run("MoE 8 layers, EP=2 x DP=2", 2, moe + ["--expert-model-parallel-size", "2",
                                                                      "--global-batch-size", "4"], count=10), one)
    if "nccl" in extras:  # the DP=2 row with NCCL communicator settings for the data-parallel groups
        one = one or bench.run("one GPU, global batch 4", 1, GPT_1_3B + ["--global-batch-size", "4"], count=20)
        capped = os.path.join(bench.trace_dir, "nccl_max_ctas_8.yaml")
        os.makedirs(bench.trace_dir, exist_ok=True)
        with open(capped, "w") as config:
            config.write("dp:\n  max_ctas: 8\ndp_cp:\n  max_ctas: 8\n")
        dp = GPT_1_3B + DP2 + ["--global-batch-size", "8"]
        bench.ratio(bench.run("DP=2, dp/dp_cp max_ctas 8", 2, dp + ["--nccl-communicator-config-path", capped],
                              count=20), one)
        bench.ratio(bench.run("DP=2, high-priority dp/dp_cp streams", 2,
                              dp + ["--high-priority-stream-groups", "dp", "dp_cp"], count=20), one)
    if "dp-bf16" in extras:  # half the reduce-scatter's bytes: the gradients reduced (and accumulated) in bf16
        one = one or bench.run("one GPU, global batch 4", 1, GPT_1_3B + ["--global-batch-size", "4"], count=20)
        bench.ratio(bench.run("DP=2, dist-opt, both overlaps, --grad-reduce-in-bf16", 2,
                              GPT_1_3B + DP2 + ["--global-batch-size", "8", "--grad-reduce-in-bf16"], count=20,
                              profile=True), one)
    if "8b" in extras:
        # Adam's moments in bf16 (the precision-aware optimizer) fit the 8B at TP=2 on 2 x 80 GB without
        # recomputation (--dry-run: 68.7 GiB per GPU; 83.7 with fp32 moments), which also lets the graph take it.
        lean = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                "--exp-avg-sq-dtype", "bf16", "--global-batch-size", "1"]
        graph = ["--cuda-graph-impl", "full_iteration"]
        one = {}
        for mode, flags, overlap in (("", [], []), (", CUDA graph", graph, []),
                                     (", CUDA graph + tp-comm-overlap", graph, ["--tp-comm-overlap"])):
            if not overlap:  # the overlapped row keeps the graph's reference
                one = bench.run(f"8B ref: 4 layers of the 8B, TP=1{mode}", 1,
                                LLAMA_8B + lean + flags + ["--num-layers", "4"], count=10)
            row = bench.run(f"Llama 8B, TP=2 + SP{mode}", 2, LLAMA_8B + lean + flags + overlap + TP2 + SP, count=10,
                            profile=not flags)
            bench.ratio(row, one, key="TFLOP/s/GPU")


def table(rows: list[dict]) -> str:
    columns = ["row", "gpus", "ms", "tokens/s/GPU", "TFLOP/s/GPU", "% of ideal", "peak MB", "comm ms/step",
               "exposed comm ms/step", "lm loss", "note"]
    formats = {"ms": "{:.1f}", "tokens/s/GPU": "{:.0f}", "TFLOP/s/GPU": "{:.1f}", "% of ideal": "{:.1f}",
               "peak MB": "{:.0f}", "comm ms/step": "{:.1f}", "exposed comm ms/step": "{:.1f}", "lm loss": "{:.4f}"}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join("" if row.get(column) is None else formats.get(column, "{}").format(row[column])
                                       for column in columns) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="tp,dp,pp", help="comma-separated subset of tp,dp,pp (the main rows)")
    parser.add_argument("--extra", default="",
                        help="comma-separated subset of mbs8,graph,cp,cp-ring,ep,8b,nccl,dp-bf16")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (gloo): checks the script")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one run may take")
    parser.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "parallel_efficiency_traces"),
                        help="where rank 0's trace of each profiled row goes")
    parser.add_argument("--skip-layer-check", action="store_true", help="leave out tools/bench/tp_overlap_check.py")
    args = parser.parse_args()

    bench = Bench(args.tiny, args.timeout, args.trace_dir)
    layer_check = ""
    if not args.skip_layer_check:
        checked = subprocess.run([sys.executable, os.path.join(ROOT, "tools/bench/tp_overlap_check.py")],
                                 capture_output=True, text=True, timeout=args.timeout)
        layer_check = checked.stdout if checked.returncode == 0 else f"FAILED:\n{checked.stderr[-2000:]}"
        print(layer_check, file=sys.stderr, flush=True)
    one = gpt_rows(bench, args.sections.split(","))
    extra_rows(bench, [extra for extra in args.extra.split(",") if extra], one)

    print(f"\n{datetime.date.today()}, commit {commit()}, {machine()}{', tiny shapes' if args.tiny else ''}, "
          f"`{' '.join(sys.argv)}`")
    if layer_check:
        print(f"\ntools/bench/tp_overlap_check.py:\n{layer_check.rstrip()}")
    print("\nprofiles (per rank):\n" + "\n".join(bench.notes))
    print("\n" + table(bench.rows))
    return 0 if all("FAILED" not in row.get("note", "") for row in bench.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
