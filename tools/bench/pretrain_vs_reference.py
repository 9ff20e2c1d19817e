"""The number users see: `pretrain_gpt.py`'s console tokens/s/GPU next to a plain PyTorch reference, one GPU.

    python tools/bench/pretrain_vs_reference.py                                  # the three benchmark models
    python tools/bench/pretrain_vs_reference.py --configs gpt2-small --variants "default=;compiled=--use-torch-compile"
    python tools/bench/pretrain_vs_reference.py --configs gpt-1.3b --profile    # + where each step's time goes

For every configuration (shapes and flags: `throughput.py`'s CONFIGS, mock data, bf16, no dropout, AdamW,
clip 1.0) this runs, one after the other on the same GPU:
- `pretrain_gpt.py` itself, once per variant (extra flags), for `--iters` iterations logged every 5: tokens/s
  is the median of the console line's tokens/s/GPU over the logged intervals after the first two (warm-up,
  compilation), peak memory the `max allocated` of its memory line (after the first interval: weights,
  gradients, optimizer state and one step's activations);
- the reference (`reference_model.py`: fp32 parameters under bf16 autocast, SDPA, fused AdamW, whole-model
  `torch.compile`, clip 1.0), timed over windows of 5 steps after 8 warm-up steps, with the same micro batch.

With `--profile`, `pretrain_gpt.py --profile --use-pytorch-profiler` profiles three iterations after the timed
ones and the reference three steps: one summary line each (kernel time per class, GPU busy, launches).
`--trace-dir DIR` keeps our runs' traces (with Python call stacks and input shapes, for `kernel_sources.py`)
under DIR/<config>_<variant>/, and there the reference's kernel table and trace (with input shapes:
reference.kernels.txt[.trace.json.gz]).
The table comes last.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]  # runs from a clone without pip install

from throughput import COMMON, CONFIGS  # noqa: E402

LOG_INTERVAL = 5
_TOKENS = re.compile(r"iteration +(\d+)/ *\d+ .*?tokens/s/GPU: (\d+)")
_MEMORY = re.compile(r"max allocated: ([\d.]+)")
_PROFILE = re.compile(r"^profile of iterations .*$", re.MULTILINE)


def run_pretrain_gpt(name: str, extra: str, iters: int, profile: bool, keep_trace: str = "") -> dict:
    """Trains `name` with pretrain_gpt.py (+ `extra` flags); tokens/s, peak GiB and the profile line (with
    the top kernels' table under "kernels"). `keep_trace`: a directory the profile's traces are copied to."""
    flags = f"{COMMON} {CONFIGS[name][0]} --global-batch-size {_micro_batch(name, extra)} {extra}"
    flags = flags.replace("--train-iters 1000", f"--train-iters {iters}")
    flags += f" --log-interval {LOG_INTERVAL}"
    with tempfile.TemporaryDirectory() as scratch:
        if profile:
            flags += (f" --profile --use-pytorch-profiler --profile-step-start {iters - 3} --profile-step-end {iters}"
                      f" --tensorboard-dir {scratch}/tb")
            if keep_trace:
                flags += " --pytorch-profiler-collect-callstack --pytorch-profiler-collect-shapes"
        done = subprocess.run([sys.executable, "pretrain_gpt.py", *shlex.split(flags)], cwd=ROOT,
                              capture_output=True, text=True)
        kernels_path = os.path.join(scratch, "torch_profile", "rank-0.kernels.txt")
        kernels = open(kernels_path).read() if os.path.exists(kernels_path) else ""
        if keep_trace and os.path.isdir(os.path.dirname(kernels_path)):
            shutil.copytree(os.path.dirname(kernels_path), keep_trace, dirs_exist_ok=True)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        error = "out of memory" if "OutOfMemoryError" in output else f"exit {done.returncode}"
        print(f"== {name} {extra!r} failed ({error}):\n{output[-3000:]}", flush=True)
        return {"error": error}
    intervals = [(int(it), float(tps)) for it, tps in _TOKENS.findall(output)]
    # Skip the first two intervals (warm-up, compilation) and, when profiling, the profiled one.
    last_timed = iters - 5 if profile else iters
    steady = [tps for it, tps in intervals[2:] if it <= last_timed]
    memory = _MEMORY.findall(output)
    result = {"tokens_per_s": statistics.median(steady) if steady else float("nan"),
              "peak_gib": float(memory[0]) / 1024 if memory else float("nan")}
    profile_lines = _PROFILE.findall(output)
    if profile_lines:
        result["profile"] = profile_lines[0]
        result["kernels"] = "\n".join(kernels.splitlines()[:26])
    return result


def _micro_batch(name: str, extra: str) -> int:
    """The micro batch of the run: a variant's --micro-batch-size wins over the configuration's."""
    found = re.findall(r"--micro-batch-size (\d+)", f"{CONFIGS[name][0]} {extra}")
    return int(found[-1])


def run_reference(name: str, micro_batch: int, profile: bool, keep_trace: str = "") -> dict:
    """The reference in a fresh process (so the two never share GPU memory). `keep_trace`: a directory its
    profile's kernel table and trace (with input shapes) go to."""
    table = os.path.join(keep_trace, "reference.kernels.txt") if keep_trace else "/tmp/reference_profile.txt"
    if keep_trace:
        os.makedirs(keep_trace, exist_ok=True)
    code = (
        "import json, sys, torch\n"
        f"sys.path[:0] = [{ROOT!r}, {HERE!r}]\n"
        "from throughput import CONFIGS, timed_run\n"
        "from reference_model import build_reference, reference_train_step\n"
        "from step_profile import profile_steps\n"
        f"shape = CONFIGS[{name!r}][1]\n"
        "device = torch.device('cuda')\n"
        "model, optimizer = build_reference(shape, device)\n"
        "generator = torch.Generator(device=device).manual_seed(0)\n"
        "def step():\n"
        f"    data = torch.randint(0, shape.vocab_size, ({micro_batch}, shape.seq_length + 1), device=device,"
        " generator=generator)\n"
        "    reference_train_step(model, optimizer, data[:, :-1], data[:, 1:])\n"
        "result = {}\n"
        "try:\n"
        "    seconds = timed_run(step, 8, 30, 5)\n"
        f"    result = {{'tokens_per_s': {micro_batch} * shape.seq_length / seconds,\n"
        "              'peak_gib': torch.cuda.max_memory_allocated() / 2**30}\n"
        f"    if {profile}:\n"
        f"        result['profile'] = profile_steps(step, 3, {table!r}, 'reference')\n"
        "except torch.OutOfMemoryError:\n"
        "    result = {'error': 'out of memory'}\n"
        "print('RESULT ' + json.dumps(result))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"== reference {name} failed:\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
        return {"error": f"exit {done.returncode}"}
    return json.loads(lines[-1][len("RESULT "):])


def _cell(row: dict, key: str, scale: float, digits: int, suffix: str = "") -> str:
    return row["error"] if "error" in row else f"{row[key] / scale:.{digits}f}{suffix}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="gpt2-small,gpt-1.3b,llama-3.6b", help=f"subset of {list(CONFIGS)}")
    parser.add_argument("--variants", default="default=",
                        help="our runs as 'label=extra pretrain_gpt.py flags', separated by ';'")
    parser.add_argument("--iters", type=int, default=40, help="pretrain_gpt.py iterations per run")
    parser.add_argument("--profile", action="store_true", help="profile three steps of each run")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--trace-dir", default="", help="with --profile: keep the traces under this directory")
    options = parser.parse_args()
    variants = [entry.partition("=")[::2] for entry in options.variants.split(";") if entry.strip()]
    rows = []
    for name in options.configs.split(","):
        references = {}
        for label, extra in variants:
            keep_trace = (os.path.join(options.trace_dir, f"{name}_{re.sub(r'[^A-Za-z0-9.-]', '_', label.strip())}")
                          if options.trace_dir and options.profile else "")
            ours = run_pretrain_gpt(name, extra, options.iters, options.profile, keep_trace)
            micro_batch = _micro_batch(name, extra)
            if not options.skip_reference and micro_batch not in references:
                references[micro_batch] = run_reference(name, micro_batch, options.profile, keep_trace)
            reference = references.get(micro_batch, {"error": "skipped"})
            for who, result in (("ours", ours), ("reference", reference)):
                if "profile" in result:
                    print(f"{name} {label} {who}: {result['profile']}", flush=True)
                if "kernels" in result:
                    print(result["kernels"], flush=True)
            ratio = (f"{ours['tokens_per_s'] / reference['tokens_per_s']:.2f}x"
                     if "error" not in ours and "error" not in reference else "")
            rows.append(f"| {name} | {label.strip()} | {micro_batch} | {_cell(ours, 'tokens_per_s', 1e3, 1, 'k')} | "
                        f"{_cell(reference, 'tokens_per_s', 1e3, 1, 'k')} | {ratio} | {_cell(ours, 'peak_gib', 1, 1)} | "
                        f"{_cell(reference, 'peak_gib', 1, 1)} |")
            print(rows[-1], flush=True)
    import torch

    print(f"\ndevice: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| config | variant | mbs | pretrain_gpt.py tokens/s | reference tokens/s | ratio | ours GiB | reference GiB |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
