"""Write the Megatron-LM interchange fixtures on a GPU machine, and check this project's checkpoints in
Megatron-LM, both with the real Megatron-LM (its `pretrain_gpt.py`, `--transformer-impl local`):

    python tools/megatron_interop/make_fixtures.py --megatron .megatron-lm --gpus 1 --out $OUT
    python tools/megatron_interop/make_fixtures.py --megatron .megatron-lm --gpus 2 --out $OUT

`--gpus 1` runs the one-process configurations (`tp1`), `--gpus 2` the two-process ones (`tp2`, `pp2`, `dp2`);
`configs.py` lists them. Two directions (`--direction`, default both; `self`: Megatron-LM resuming its own
checkpoints, the baseline where it cannot resume a configuration at all):

- `megatron`: Megatron-LM trains each configuration 20 iterations on `tests/fixtures/megatron_lm/data`,
  saving at 10; its iteration-10 checkpoint and the losses of all 20 iterations are the fixture that the CPU
  tests resume from (`tests/functional_tests/test_megatron_interop.py`).
- `ours`: this project's `pretrain_gpt.py` trains the same configuration on the CPU (as a user without a GPU
  would save it), 20 iterations saving at 10; Megatron-LM then `--load`s that iteration-10 checkpoint and
  trains 11..20 on the GPU. Its losses must equal ours: fp32 within `--rtol` (1e-5) relative, bf16 within
  `--bf16-rtol` (1e-3: CPU and GPU bf16 GEMMs round differently, 3e-5 measured where the state is right;
  an optimizer state read wrongly shows as 5e-3 and more).

Megatron-LM's console line of a run's second iteration is the mean of its first two (see
`megatron_logged`): a resumed run's line of iteration 12 is compared with the mean of 11 and 12.
`--megatron-fixes` runs Megatron-LM's resumes with `megatron_fixes.py`, without which Megatron-LM main cannot
load any distributed-optimizer checkpoint with torch's Adam (no apex, no Transformer Engine), its own
included (`--direction self` shows it on a GPU, `load_check.py` on a CPU).

Determinism: no dropout, fixed seed, `NVIDIA_TF32_OVERRIDE=0` (fp32 GEMMs in full fp32 on the GPU).
Megatron-LM's tokenizer `GPT2BPETokenizer` asks the Hugging Face hub for `gpt2`'s tokenizer class; without a
network, each run's working folder holds a `gpt2/` folder with just that (`config.json`,
`tokenizer_config.json`), and the vocabulary and merges come from `--vocab-file`/`--merge-file` as usual.
Megatron-LM's start-up `make` of its dataset helpers is answered by the library that `prepare_megatron.py`
built (or that this script builds with g++ and pybind11 when it is missing).

What comes back under `--out`: `results.json` (per run: the exact command with its path placeholders, the
environment, exit code, losses and grad norms per iteration, and for `ours` the comparison), `summary.md`
(the table printed last), and `fixtures-N.tar.gz` (each under 15 MiB): `megatron/<config>/checkpoint/`
(iteration 10 only, the tracker file naming 10) and every run's log.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

from configs import MATRIX, SAVE_ITERATION, TRAIN_ITERATIONS, Config, command
from megatron_env import MegatronEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(ROOT, "tests", "fixtures", "megatron_lm", "data")
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
GPU_LAYOUTS = {1: ("tp1",), 2: ("tp2", "pp2", "dp2")}
TAR_LIMIT = 15 * 2**20


def read_losses(log: str) -> dict[int, list[float]]:
    """{iteration: [lm loss, grad norm]} from the console lines of a run (Megatron's format, which this
    project's console line shares)."""
    losses = {}
    for match in LOSS_LINE.finditer(log):
        losses[int(match.group(1))] = [float(match.group(2)), float(match.group(3))]
    return losses


def failure(log: str) -> str:
    """The first traceback of a failed run's log (a worker's root cause, not the launcher's report)."""
    start = log.find("Traceback (most recent call last)")
    return log[start:start + 2500] if start >= 0 else log[-2500:]


def keep_iteration(checkpoint: str, iteration: int) -> None:
    """Deletes every `iter_*` folder of `checkpoint` but `iteration`'s, and names it in the tracker file."""
    for name in os.listdir(checkpoint):
        if name.startswith("iter_") and name != f"iter_{iteration:07d}":
            shutil.rmtree(os.path.join(checkpoint, name))
    with open(os.path.join(checkpoint, "latest_checkpointed_iteration.txt"), "w") as file:
        file.write(str(iteration))


def _launch(processes: int, script: str, argv: list[str], env: dict, cwd: str, log: str,
            deadline: float) -> tuple[int, str, float]:
    """Runs `script` under torchrun (`--standalone`: a free port, so runs may overlap) until `deadline` (a
    time.time()); returns the exit code (124: out of time), the output and the seconds it took."""
    if deadline - time.time() < 10:
        return 124, "not started: the --deadline had passed", 0.0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    start = time.time()
    with open(log, "w") as sink:
        # A session of its own, so that running out of time ends the launcher and its workers together.
        process = subprocess.Popen(launcher + [script] + argv, cwd=cwd, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=deadline - time.time())
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = 124
    with open(log, errors="replace") as source:
        return code, source.read(), time.time() - start


class Runner:
    """Runs the configurations' jobs and collects their records."""

    def __init__(self, megatron: MegatronEnvironment, work: str, gpus: int, deadline: float, fixes: bool = False):
        self.megatron, self.work, self.gpus, self.deadline, self.fixes = megatron, work, gpus, deadline, fixes
        self.paths = {"data": os.path.join(DATA, "stdlib_text_document"), "vocab": os.path.join(DATA, "vocab.json"),
                      "merges": os.path.join(DATA, "merges.txt")}

    def _megatron_run(self, config: Config, folder: str, gpu: int, save: str | None, load: str | None) -> dict:
        placeholders = command(config, save=save and "{save}", load=load and "{load}")
        argv = command(config, save=save, load=load,
                       paths=dict(self.paths, save=save or "", load=load or "", cache=os.path.join(folder, "cache")))
        visible = ",".join(str(g) for g in range(self.gpus)) if config.processes > 1 else str(gpu)
        env = self.megatron.environment(visible)
        os.makedirs(folder, exist_ok=True)
        fixes = self.fixes and load is not None
        script = os.path.join(HERE, "megatron_fixes.py") if fixes else self.megatron.script
        argv = [self.megatron.script, *argv] if fixes else argv
        code, log, seconds = _launch(config.processes, script, argv, env, self.megatron.cwd,
                                     os.path.join(folder, "megatron.log"), self.deadline)
        return {"framework": "megatron-lm", "command": ["pretrain_gpt.py", *placeholders], "megatron_fixes": fixes,
                "environment": {k: env[k] for k in self.megatron.RECORDED if k in env}, "exit_code": code,
                "seconds": round(seconds, 1), "losses": read_losses(log), "error": failure(log) if code else ""}

    def our_run(self, config: Config, folder: str, save: str) -> dict:
        """This project's pretrain_gpt.py trains `config` on the CPU, saving into `save`; the run's record."""
        argv = command(config, save=save, paths=dict(self.paths, save=save, cache=os.path.join(folder, "cache")))
        env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        code, log, seconds = _launch(config.processes, os.path.join(ROOT, "pretrain_gpt.py"), argv, env, ROOT,
                                     os.path.join(folder, "ours.log"), self.deadline)
        return {"framework": "ours (CPU)", "command": ["pretrain_gpt.py", *command(config)], "exit_code": code,
                "seconds": round(seconds, 1), "losses": read_losses(log), "error": failure(log) if code else ""}

    def megatron_writes(self, config: Config, gpu: int) -> dict:
        """Megatron-LM trains 20 iterations, saving at 10: the fixture."""
        folder = os.path.join(self.work, "megatron", config.name)
        os.makedirs(folder)
        checkpoint = os.path.join(folder, "checkpoint")
        record = self._megatron_run(config, folder, gpu, save=checkpoint, load=None)
        if record["exit_code"] == 0:
            keep_iteration(checkpoint, SAVE_ITERATION)
        return {"config": config.name, "direction": "megatron", "processes": config.processes,
                "megatron_run": record}

    def megatron_resumes_itself(self, config: Config, gpu: int, rtols: dict) -> dict:
        """Megatron-LM writes as in `megatron_writes`, then resumes its own iteration-10 checkpoint: the
        baseline that `ours` is judged against where Megatron-LM itself cannot resume a configuration."""
        result = self.megatron_writes(config, gpu)
        result["direction"] = "self"
        if result["megatron_run"]["exit_code"] != 0:
            return result
        folder = os.path.join(self.work, "megatron", config.name)
        resumed = self._megatron_run(config, os.path.join(folder, "resume"), gpu, save=None,
                                     load=os.path.join(folder, "checkpoint"))
        result["megatron_resume"] = resumed
        result["comparison"] = compare(result["megatron_run"]["losses"], resumed["losses"], rtols[config.precision])
        return result

    def megatron_loads_ours(self, config: Config, gpu: int, rtols: dict) -> dict:
        """Ours trains 20 iterations on the CPU saving at 10; Megatron-LM resumes from 10 on the GPU."""
        folder = os.path.join(self.work, "ours", config.name)
        os.makedirs(folder)
        checkpoint = os.path.join(folder, "checkpoint")
        ours = self.our_run(config, folder, save=checkpoint)
        result = {"config": config.name, "direction": "ours", "processes": config.processes, "our_run": ours}
        if ours["exit_code"] != 0:
            return result
        keep_iteration(checkpoint, SAVE_ITERATION)
        resumed = self._megatron_run(config, folder, gpu, save=None, load=checkpoint)
        result["megatron_resume"] = resumed
        result["comparison"] = compare(ours["losses"], resumed["losses"], rtols[config.precision])
        return result


def megatron_logged(losses: dict, first: int) -> dict:
    """{iteration: lm loss} as Megatron-LM's console prints the per-iteration `losses` ({iteration: [loss,
    grad norm]}) of a run that starts at iteration `first`, at --log-interval 1: its training_log logs a
    run's first iteration at once but does not reset the loss sums after it ("so normal interval stats
    remain accurate"), so the line of iteration first + 1 holds the mean of the first two."""
    logged = {i: values[0] for i, values in losses.items()}
    if first in losses and first + 1 in losses:
        logged[first + 1] = (losses[first][0] + losses[first + 1][0]) / 2
    return logged


def compare(reference: dict, resumed: dict, rtol: float) -> dict:
    """Largest relative difference of the lm loss Megatron-LM's resumed run printed from what it prints for
    `reference`'s losses (megatron_logged), over the iterations after the checkpoint; `passed` against
    `rtol`."""
    expected = list(range(SAVE_ITERATION + 1, TRAIN_ITERATIONS + 1))
    missing = [i for i in expected if i not in resumed or i not in reference]
    if missing:
        return {"passed": False, "missing_iterations": missing}
    logged = megatron_logged({i: reference[i] for i in expected}, SAVE_ITERATION + 1)
    worst = max(abs(resumed[i][0] - logged[i]) / abs(logged[i]) for i in expected)
    return {"max_rel_loss_diff": worst, "rtol": rtol, "passed": worst <= rtol}


def summarize(results: list[dict]) -> str:
    """The table printed last: per run its exit code, losses at 11 and 20 and, for `ours`, the comparison."""
    nan = [float("nan")]
    lines = ["| config | direction | exit | loss 11 | loss 20 | max rel. diff | seconds |",
             "|---|---|---|---|---|---|---|"]
    for result in sorted(results, key=lambda r: (r["direction"], r["config"])):
        run = result.get("megatron_resume") or result.get("megatron_run") or result["our_run"]
        comparison = result.get("comparison", {})
        diff = comparison.get("max_rel_loss_diff")
        verdict = "" if not comparison else ("ok" if comparison.get("passed") else "FAIL")
        lines.append(f"| {result['config']} | {result['direction']} | {run['exit_code']} | "
                     f"{run['losses'].get(11, nan)[0]:.6E} | {run['losses'].get(20, nan)[0]:.6E} | "
                     f"{'' if diff is None else f'{diff:.2e}'} {verdict} | {run['seconds']} |")
    return "\n".join(lines)


def check_arguments(megatron_source: str) -> bool:
    """Megatron-LM's own argument validation on every command line of the matrix (both directions), on
    any machine: prints one line per command, returns whether all passed."""
    ok = True
    with tempfile.TemporaryDirectory() as work:
        megatron = MegatronEnvironment(megatron_source, work, build_helpers=False)
        paths = {"data": os.path.join(DATA, "stdlib_text_document"), "vocab": os.path.join(DATA, "vocab.json"),
                 "merges": os.path.join(DATA, "merges.txt"), "save": os.path.join(work, "save"),
                 "load": os.path.join(work, "load"), "cache": os.path.join(work, "cache")}
        labelled = [(config, label, argv) for config in MATRIX
                    for label, argv in (("writes", command(config, paths=paths)),
                                        ("resumes", command(config, save=None, load="{load}", paths=paths)))]
        lines = megatron.validate([(argv, config.processes) for config, _, argv in labelled])
        for (config, label, _), line in zip(labelled, lines):
            ok &= line.startswith("VALIDATED")
            print(f"{config.name:26s} {label:8s} {line}")
    return ok


def pack(work: str, out: str) -> list[str]:
    """Tars the checkpoints and logs under `work` into `out/fixtures-N.tar.gz`, each under TAR_LIMIT."""
    members = []
    for direction in ("megatron", "ours"):
        top = os.path.join(work, direction)
        for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
            folder = os.path.join(top, name)
            for base, _, files in os.walk(folder):
                for file in files:
                    path = os.path.join(base, file)
                    relative = os.path.relpath(path, work)
                    if direction == "ours" and not file.endswith(".log"):
                        continue  # our checkpoints are rebuilt on any CPU: only the logs travel
                    if "/cache/" in relative:
                        continue
                    members.append((path, relative, os.path.getsize(path)))
    archives, current, size = [], None, 0
    for path, relative, length in members:
        if current is None or size + length > TAR_LIMIT:
            if current:
                current.close()
            archives.append(os.path.join(out, f"fixtures-{len(archives)}.tar.gz"))
            current, size = tarfile.open(archives[-1], "w:gz"), 0
        current.add(path, arcname=relative)
        size += length  # uncompressed: float weights barely compress, so the bound holds
    if current:
        current.close()
    return archives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="Megatron-LM source folder (prepare_megatron.py)")
    parser.add_argument("--gpus", type=int, choices=sorted(GPU_LAYOUTS))
    parser.add_argument("--out", help="folder for results.json, summary.md, fixtures-N.tar.gz")
    parser.add_argument("--check-args", action="store_true",
                        help="only run Megatron-LM's argument validation on every command line (no GPU)")
    parser.add_argument("--direction", choices=("megatron", "ours", "both", "self"), default="both",
                        help="self: Megatron-LM writes and resumes its own checkpoints (the baseline of `ours`)")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all of --gpus)")
    parser.add_argument("--jobs", type=int, default=6, help="runs at the same time")
    parser.add_argument("--rtol", type=float, default=1e-5, help="fp32 loss tolerance of Megatron-LM's resume")
    parser.add_argument("--bf16-rtol", type=float, default=1e-3, help="bf16 loss tolerance of Megatron-LM's resume")
    parser.add_argument("--megatron-fixes", action="store_true",
                        help="Megatron-LM's resumes run with megatron_fixes.py (its distributed-optimizer loaders)")
    parser.add_argument("--deadline", type=int, default=480,
                        help="seconds after which runs are stopped (or not started) and the results packed")
    args = parser.parse_args()
    if args.check_args:
        raise SystemExit(0 if check_arguments(args.megatron) else 1)
    if args.gpus is None or args.out is None:
        parser.error("--gpus and --out are required (except with --check-args)")

    configs = [c for c in MATRIX if c.layout in GPU_LAYOUTS[args.gpus] and (args.only is None or c.name in args.only)]
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="megatron-interop-")
    runner = Runner(MegatronEnvironment(args.megatron, work), work, args.gpus, time.time() + args.deadline,
                    args.megatron_fixes)
    rtols = {"fp32": args.rtol, "bf16": args.bf16_rtol}
    jobs = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for index, config in enumerate(configs):
            gpu = index % args.gpus
            if args.direction in ("megatron", "both"):
                jobs.append(pool.submit(runner.megatron_writes, config, gpu))
            if args.direction in ("ours", "both"):
                jobs.append(pool.submit(runner.megatron_loads_ours, config, gpu, rtols))
            if args.direction == "self":
                jobs.append(pool.submit(runner.megatron_resumes_itself, config, gpu, rtols))
        results = [job.result() for job in jobs]
    meta = {"megatron_commit": runner.megatron.commit, "gpus": args.gpus, "data": os.path.relpath(DATA, ROOT),
            "megatron_fixes": args.megatron_fixes,
            "placeholders": {"data": "{data_dir}/stdlib_text_document", "vocab": "{data_dir}/vocab.json",
                             "merges": "{data_dir}/merges.txt", "save": "the run's checkpoint folder",
                             "load": "the checkpoint resumed", "cache": "a scratch folder"}}
    with open(os.path.join(args.out, "results.json"), "w") as file:
        json.dump({"meta": meta, "runs": results}, file, indent=1)
    table = summarize(results)
    with open(os.path.join(args.out, "summary.md"), "w") as file:
        fixes = ", resumes with megatron_fixes.py" if args.megatron_fixes else ""
        file.write(f"Megatron-LM {runner.megatron.commit}, {args.gpus} GPU(s){fixes}\n\n{table}\n")
    archives = pack(work, args.out)
    print(f"packed {len(archives)} archive(s): {', '.join(os.path.basename(a) for a in archives)}")
    print(table)


if __name__ == "__main__":
    main()
