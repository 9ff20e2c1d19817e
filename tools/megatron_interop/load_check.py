"""Megatron-LM's own `load_checkpoint` reads this project's checkpoints on a CPU, and resumes with exactly
the state this project resumes with:

    python tools/megatron_interop/load_check.py --megatron .megatron-lm [--configs NAME...] [--fixes]

For each one-process configuration of `configs.py` (default: all ten):

1. this project's `pretrain_gpt.py` trains it on the CPU (20 iterations, the iteration-10 checkpoint kept), as
   `make_fixtures.py --direction ours` does before Megatron-LM resumes it on a GPU;
2. `load_state.py` builds Megatron-LM's model, optimizer and scheduler from the same command line with
   `--load` (Megatron-LM's source, unchanged, on the CPU) and writes the state it resumed with; so does this
   project's own loader;
3. the two must be identical: iteration, consumed samples, floating-point operations, scheduler state, and
   per parameter the model weights, fp32 main params, Adam's moments and step, learning rate, weight decay,
   betas and eps (bit for bit: both read the same file), each param with an Adam step tensor of its own,
   the python/numpy/torch generators, and Megatron-LM's
   CUDA generator and tensor-parallel streams equal to those its own seeding gives (a checkpoint written on
   a CPU carries those, see megatron/training/checkpointing/rng.py);
4. the baseline, where a fixture exists (`tests/fixtures/megatron_lm/gpu1/megatron/<config>`): the same with
   Megatron-LM's own checkpoint of that configuration, written by Megatron-LM on a GPU.

`--fixes` installs `megatron_fixes.py` in Megatron-LM's loads: without them Megatron-LM main cannot load a
distributed-optimizer checkpoint with torch's Adam at all (its own included; step 4 shows it). Each load takes
Megatron-LM's import time (about 10 s); all ten configurations take a few minutes on two cores. The exit code
is 0 when every load of ours succeeded and matched.
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from configs import MATRIX, SAVE_ITERATION, Config, command
from make_fixtures import DATA, ROOT, Runner, keep_iteration
from megatron_env import MegatronEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron_lm", "gpu1", "megatron")
SCALARS = ("iteration", "consumed_train_samples", "floating_point_operations_so_far", "scheduler",
           "separate_steps")


def load_state(framework: str, megatron: MegatronEnvironment, config: Config, checkpoint: str, out: str,
               fixes: bool) -> dict:
    """Runs load_state.py for `framework` on `checkpoint`; its state, or {"error": ...}."""
    paths = {"data": os.path.join(DATA, "stdlib_text_document"), "vocab": os.path.join(DATA, "vocab.json"),
             "merges": os.path.join(DATA, "merges.txt"), "cache": os.path.join(os.path.dirname(out), "cache")}
    argv = command(config, save=None, load=checkpoint, paths=paths)
    launcher = [sys.executable, os.path.join(HERE, "load_state.py"), "--framework", framework, "--argv",
                json.dumps(argv), "--out", out] + (["--fixes"] if fixes else [])
    if framework == "megatron":
        env, cwd = megatron.environment(""), megatron.cwd
    else:
        env, cwd = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"), ROOT
    result = subprocess.run(launcher, env=env, cwd=cwd, capture_output=True, text=True)
    if not os.path.exists(out):
        return {"error": f"load_state.py exited {result.returncode}:\n{result.stderr[-3000:]}"}
    return torch.load(out, weights_only=False)


def differences(megatron: dict, ours: dict, seeded_cuda_rng: bool) -> list[str]:
    """What differs between Megatron-LM's and this project's resumed state (empty: identical).
    `seeded_cuda_rng`: Megatron-LM's CUDA generator and streams must equal its own seeding's."""
    found = [f"{key}: Megatron-LM {megatron[key]!r}, ours {ours[key]!r}" for key in SCALARS
             if megatron[key] != ours[key]]
    if set(megatron["params"]) != set(ours["params"]):
        found.append(f"parameter names differ: {sorted(set(megatron['params']) ^ set(ours['params']))}")
    for name in sorted(set(megatron["params"]) & set(ours["params"])):
        theirs, mine = megatron["params"][name], ours["params"][name]
        for key in sorted(set(theirs) | set(mine)):
            a, b = theirs.get(key), mine.get(key)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                if a.shape != b.shape or not torch.equal(a, b):
                    gap = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {a.shape} {b.shape}"
                    found.append(f"{name}.{key}: max |diff| {gap}")
            elif a != b:
                found.append(f"{name}.{key}: Megatron-LM {a!r}, ours {b!r}")
    rng, our_rng = megatron["rng"], ours["rng"]
    if rng["random"] != our_rng["random"]:
        found.append("python random state differs")
    if not (rng["numpy"] == our_rng["numpy"]).all():
        found.append("numpy random state differs")
    if not torch.equal(rng["torch"], our_rng["torch"]):
        found.append("torch CPU generator state differs")
    if seeded_cuda_rng:
        seeded, loaded = rng["cuda"]["seeded"], rng["cuda"]["loaded"]
        if not torch.equal(seeded["cuda"], loaded["cuda"]):
            found.append("Megatron-LM's CUDA generator after the load is not its seeded one")
        if seeded["tracker"].keys() != loaded["tracker"].keys() or not all(
                torch.equal(seeded["tracker"][name], loaded["tracker"][name]) for name in seeded["tracker"]):
            found.append("Megatron-LM's tensor-parallel RNG streams after the load are not its seeded ones")
    return found


def verdict(megatron: dict, ours: dict, seeded_cuda_rng: bool) -> tuple[bool, str]:
    """(passed, a line for the table) for one checkpoint."""
    for who, state in (("Megatron-LM", megatron), ("ours", ours)):
        if "error" in state:
            last = [line for line in state["error"].strip().splitlines() if line.strip()][-1]
            return False, f"{who} fails: {last}"
    found = differences(megatron, ours, seeded_cuda_rng)
    if found:
        return False, f"{len(found)} difference(s): " + "; ".join(found[:3])
    return True, f"identical ({len(ours['params'])} params, iteration {ours['iteration']})"


def check(config: Config, megatron: MegatronEnvironment, work: str, fixes: bool) -> dict:
    """Steps 1-4 of the module docstring for one configuration."""
    folder = os.path.join(work, config.name)
    os.makedirs(folder)
    checkpoint = os.path.join(folder, "checkpoint")
    record = {"config": config.name}
    ours_run = Runner(megatron, work, 1, time.time() + 600).our_run(config, folder, save=checkpoint)
    if ours_run["exit_code"] != 0:
        record["ours"] = (False, f"our run failed: {ours_run['error'][-500:]}")
        return record
    keep_iteration(checkpoint, SAVE_ITERATION)
    states = [load_state(framework, megatron, config, checkpoint, os.path.join(folder, f"{framework}.pt"), fixes)
              for framework in ("megatron", "ours")]
    record["ours"] = verdict(*states, seeded_cuda_rng=True)
    fixture = os.path.join(FIXTURES, config.name, "checkpoint")
    if os.path.isdir(fixture):
        states = [load_state(framework, megatron, config, fixture, os.path.join(folder, f"{framework}-own.pt"),
                             fixes) for framework in ("megatron", "ours")]
        record["megatron_own"] = verdict(*states, seeded_cuda_rng=False)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="Megatron-LM source folder (prepare_megatron.py)")
    parser.add_argument("--configs", nargs="*", default=None, help="configuration names (default: the -tp1 ones)")
    parser.add_argument("--fixes", action="store_true", help="install megatron_fixes.py in Megatron-LM's loads")
    parser.add_argument("--jobs", type=int, default=2, help="configurations checked at the same time")
    args = parser.parse_args()
    configs = [c for c in MATRIX if c.layout == "tp1" and (args.configs is None or c.name in args.configs)]
    unknown = set(args.configs or []) - {c.name for c in configs}
    if unknown:
        parser.error(f"unknown or multi-process configuration(s) {sorted(unknown)}; valid: "
                     f"{', '.join(c.name for c in MATRIX if c.layout == 'tp1')}")
    with tempfile.TemporaryDirectory(prefix="megatron-load-check-") as work:
        megatron = MegatronEnvironment(args.megatron, work, build_helpers=False)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            records = list(pool.map(lambda config: check(config, megatron, work, args.fixes), configs))
    print(f"Megatron-LM {megatron.commit} loading on a CPU{' with megatron_fixes.py' if args.fixes else ''}\n")
    print("| config | our checkpoint | Megatron-LM's own checkpoint (fixture) |\n|---|---|---|")
    for record in records:
        own = record.get("megatron_own")
        print(f"| {record['config']} | {record['ours'][1]} | {own[1] if own else 'no fixture'} |")
    raise SystemExit(0 if all(record["ours"][0] for record in records) else 1)


if __name__ == "__main__":
    main()
