"""Megatron-LM's own GPT and MoE functional-test configurations, as this project's test data.

    python tools/megatron_interop/functional_configs.py --repo /path/to/Megatron-LM[.git] \\
        --output tests/fixtures/megatron_functional/configs.json [--train-all]

Reads every tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml of the repository's commit that
trains (MODE neither inference nor rl) and writes one entry per configuration:

    argv         its MODEL_ARGS as Megatron-LM's CI passes them (tests/functional_tests/shell_test_utils/
                 _run_training.sh: `true` is the bare flag, "[a b]" two values, ...), then made tiny and local:
                 the shape flags shrunk (2 layers, or the fewest the pipeline split allows; 16 channels per
                 head, heads the fewest the tensor-parallel split allows; sequence 64; micro-batch <= 2; 3
                 iterations; evaluation 1 iteration; 4+ experts), the data generated (--mock-data; the FIM
                 dataset reads the fixture corpus, split 90,5,5), a step batch-size schedule's batches in its
                 ratios, stepping in the first iterations, offloading (--fine-grained-activation-offloading)
                 of tensors of any size, the GPT-2 BPE of the fixtures, the paths
                 {scratch}/..., no loader workers. Every flag not listed in `changes` is as Megatron-LM's file
                 writes it.
    changes      each of those edits, "flag: before -> after"
    world_size   8, as Megatron-LM's CI (or the layout's size when larger): validation runs at that size
    cpu          the edits of the one-rank CPU training run: every parallel size 1, and the flags that need
                 several ranks dropped (functional_runs.py applies them); two microbatches per step, or a step
                 schedule's batches at data-parallel size 1; a --moe-layer-freq list two layers (one dense,
                 one MoE)
    expect       "train" when validation accepts it (the test trains it), else what refuses it: argparse's
                 message (a flag not built here) or validation's list of problems, verbatim
    ci           trained in CI: the fewest configurations that together train every flag their one-rank runs
                 keep (the others are validated in CI and trained by --train-all)
"""

import argparse
import json
import math
import re
import subprocess
import tempfile

import yaml

from functional_runs import cpu_command, train_in_process, validation_outcome

SUITES = ("gpt", "moe")
CI_WORLD_SIZE = 8
# Placeholders of Megatron-LM's files (filled by its CI from the environment) -> this project's; any other
# ${NAME} becomes {scratch}/NAME.
PLACEHOLDERS = {"${CHECKPOINT_SAVE_PATH}": "{scratch}/save", "${CHECKPOINT_LOAD_PATH}": "{scratch}/load",
                "${TENSORBOARD_PATH}": "{scratch}/tensorboard", "${DATA_CACHE_PATH}": "{scratch}/cache",
                "${WANDB_SAVE_PATH}": "{scratch}/wandb", "${WANDB_EXPERIMENT}": "functional", "${REPEAT}": "1234"}
DATA_FLAGS = ("--data-path", "--split", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model")
# Parallel flags the one-rank run sets to 1 or drops (they need several ranks).
CPU_SIZES = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
             "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-distributed-optimizer-instances")
CPU_DROPPED = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
               "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
               "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
               "--microbatch-group-size-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout",
               "--tp-comm-overlap", "--overlap-param-gather-with-optimizer-step", "--defer-embedding-wgrad-compute",
               "--wgrad-deferral-limit", "--overlap-p2p-communication-warmup-flush",
               "--hierarchical-context-parallel-sizes", "--overlap-moe-expert-parallel-comm")


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def read_configs(repo: str, commit: str) -> list[tuple[str, dict]]:
    """(suite/name, the YAML with every scalar as written) of each training configuration, sorted."""
    listed = _git(repo, "ls-tree", "-r", "--name-only", commit, "tests/functional_tests/test_cases").split()
    configs = []
    for path in sorted(listed):
        parts = path.split("/")
        if len(parts) != 6 or parts[3] not in SUITES or parts[5] != "model_config.yaml":
            continue
        # BaseLoader keeps every scalar as its text, as the CI's yq prints it ("1.0e-5", ".01", "true").
        config = yaml.load(_git(repo, "show", f"{commit}:{path}"), Loader=yaml.BaseLoader)
        if config.get("MODE") in ("inference", "rl") or not config.get("MODEL_ARGS"):
            continue
        configs.append((f"{parts[3]}/{parts[4]}", config))
    return configs


def launcher_argv(model_args: dict) -> list[str]:
    """MODEL_ARGS as the CI's _run_training.sh turns them into arguments (YAML merge keys `<<` resolved
    first, as its `yq explode` does: the file's own keys win)."""
    bases = model_args.get("<<", [])
    merged = {}
    for base in bases if isinstance(bases, list) else [bases]:
        merged.update(base)
    merged.update({flag: value for flag, value in model_args.items() if flag != "<<"})
    argv = []
    for flag, value in merged.items():
        if isinstance(value, list):
            argv += [flag, *(str(item) for item in value)]
            continue
        value = re.sub(r"\$\{(\w+)\}", lambda found: PLACEHOLDERS.get(found.group(0), f"{{scratch}}/{found.group(1)}"),
                       str(value).strip())
        if value == "":
            continue
        if value == "true":
            argv.append(flag)
        elif value.startswith("[") and value.endswith("]"):
            argv += [flag, *value[1:-1].split()]
        else:
            argv += [flag, value]
    return argv


def as_dict(argv: list[str]) -> dict:
    """{flag: [values]} of an argument list (a switch has no values), in order."""
    flags, current = {}, None
    for arg in argv:
        if arg.startswith("--"):
            current = arg
            flags[current] = []
        else:
            flags[current].append(arg)
    return flags


def as_argv(flags: dict) -> list[str]:
    return [item for flag, values in flags.items() for item in (flag, *values)]


def _int(flags: dict, flag: str, default: int) -> int:
    values = flags.get(flag)
    return int(values[0]) if values else default


class _Shrink:
    """The edits of one configuration, recorded as they are made."""

    def __init__(self, flags: dict):
        self.flags, self.changes = flags, []

    def set(self, flag: str, *values) -> None:
        values = [str(value) for value in values]
        before = self.flags.get(flag)
        if before == values:
            return
        self.flags[flag] = values
        shown = " ".join(before) if before else ("(on)" if before == [] else "(unset)")
        self.changes.append(f"{flag}: {shown} -> {' '.join(values) or '(on)'}")

    def drop(self, flag: str) -> None:
        if flag in self.flags:
            self.changes.append(f"{flag}: {' '.join(self.flags.pop(flag)) or '(on)'} -> (dropped)")


def _shape(shrink: _Shrink) -> None:
    flags = shrink.flags
    tp = _int(flags, "--tensor-model-parallel-size", 1)
    groups = _int(flags, "--num-query-groups", 1) if "--group-query-attention" in flags else 1
    heads = math.lcm(4, tp, groups)
    shrink.set("--num-attention-heads", heads)
    shrink.set("--hidden-size", heads * 16)
    for flag in ("--kv-channels",):
        if flag in flags:
            shrink.set(flag, 16)
    for flag, size in (("--ffn-hidden-size", 2 * heads * 16), ("--moe-ffn-hidden-size", heads * 16),
                       ("--moe-shared-expert-intermediate-size", heads * 16)):
        if flag in flags:
            shrink.set(flag, size)
    for flag in ("--seq-length", "--max-position-embeddings"):
        shrink.set(flag, 64)
    if "--num-experts" in flags:
        # A multiple of EP and of the routing groups, with at least top-k experts in the groups a token may
        # use (group-limited routing: --moe-router-group-topk of --moe-router-num-groups groups).
        groups = _int(flags, "--moe-router-num-groups", 1)
        step = math.lcm(4, _int(flags, "--expert-model-parallel-size", 1), groups)
        experts = step
        while experts * _int(flags, "--moe-router-group-topk", groups) < _int(flags, "--moe-router-topk", 2) * groups:
            experts += step
        shrink.set("--num-experts", experts)
    if "--vocab-size" in flags:
        shrink.set("--vocab-size", 1000)
    if "--fine-grained-activation-offloading" in flags:
        # The default (2^20 elements) is above every tensor of the tiny model: offload them all.
        shrink.set("--min-offloaded-tensor-size", 1)


def _step_schedule(flags: dict, per_step: int) -> tuple[str, int]:
    """(--step-batch-size-schedule made tiny, the samples of its first 3 steps): the batches in the written
    ratios as multiples of `per_step` (micro batch x DP), each threshold (tokens) where the previous step ends,
    so that every step of the schedule is trained from the first iterations on."""
    from megatron.core.num_microbatches_calculator import parse_step_batch_size_schedule

    batches = [batch for _, batch in parse_step_batch_size_schedule(" ".join(flags["--step-batch-size-schedule"]))]
    batches = [per_step * max(1, round(batch / batches[0])) for batch in batches]
    seq_length = _int(flags, "--seq-length", 64)
    thresholds = [seq_length * sum(batches[:index]) for index in range(len(batches))]
    schedule = " ".join(f"{threshold}:{batch}" for threshold, batch in zip(thresholds, batches))
    return schedule, sum(batches[:3])


def _batch(shrink: _Shrink, world_size: int) -> None:
    flags = shrink.flags
    model = (_int(flags, "--tensor-model-parallel-size", 1) * _int(flags, "--pipeline-model-parallel-size", 1)
             * _int(flags, "--context-parallel-size", 1))
    dp = world_size // model
    mbs = _int(flags, "--micro-batch-size", 1)
    microbatches = max(1, _int(flags, "--global-batch-size", mbs * dp) // (mbs * dp))
    small = min(mbs, 2)
    shrink.set("--micro-batch-size", small)
    if "--global-batch-size" in flags:
        shrink.set("--global-batch-size", small * dp * microbatches)
    if "--train-iters" in flags:
        shrink.set("--train-iters", 3)
    samples = 3 * small * dp * microbatches
    if "--step-batch-size-schedule" in flags:
        schedule, samples = _step_schedule(flags, small * dp)
        shrink.set("--step-batch-size-schedule", schedule)
    if "--train-samples" in flags:
        shrink.set("--train-samples", samples)
    if _int(flags, "--eval-iters", 100) > 1:
        shrink.set("--eval-iters", 1)
    if "--eval-micro-batch-size" in flags:
        shrink.set("--eval-micro-batch-size", min(_int(flags, "--eval-micro-batch-size", 1), 2))
    if "--eval-global-batch-size" in flags:
        shrink.set("--eval-global-batch-size", _int(flags, "--eval-micro-batch-size", small) * dp)


def _data(shrink: _Shrink) -> None:
    flags = shrink.flags
    fim = "--fim-data" in flags
    tokenizer = flags.get("--tokenizer-type", ["GPT2BPETokenizer"])[0]
    for flag in DATA_FLAGS:
        if flag not in ("--split", "--tokenizer-type"):
            shrink.drop(flag)
    if fim:  # Megatron-LM's FIM dataset refuses generated data; the corpus's 73 documents split 90/5/5
        shrink.set("--data-path", "{data}")
        shrink.set("--split", "90,5,5")
    elif "--mock-data" not in flags:
        shrink.set("--mock-data")
    if tokenizer != "NullTokenizer":
        if "--tokenizer-type" in flags:
            shrink.set("--tokenizer-type", "GPT2BPETokenizer")
        shrink.set("--vocab-file", "{vocab}")
        shrink.set("--merge-file", "{merges}")
    shrink.set("--num-workers", 0)


def _layers(shrink: _Shrink, world_size: int) -> None:
    """The fewest layers, from 2 (from N with --linear-attention-freq N, so that a softmax-attention layer
    stays among the linear ones) up to the configuration's own count, whose split over the pipeline stages
    validation accepts (interleaved schedules keep two virtual stages per rank); the count as written when
    none is accepted. A --moe-layer-freq or --linear-attention-freq list, or a pipeline layout, fixes the
    count."""
    flags = shrink.flags
    patterns = (flags.get("--moe-layer-freq", ["1"])[0], flags.get("--linear-attention-freq", ["1"])[0])
    if any(pattern.startswith(("[", "(")) for pattern in patterns) or "--pipeline-model-parallel-layout" in flags:
        return
    original = flags["--num-layers"]
    fewest = max(2, int(patterns[1]))
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        shrink.set("--num-layers-per-virtual-pipeline-stage", 1)
        fewest = 2 * _int(flags, "--pipeline-model-parallel-size", 1)
    chosen = int(original[0])
    for layers in range(fewest, chosen):
        flags["--num-layers"] = [str(layers)]
        outcome = validation_outcome(as_argv(flags), world_size)
        if not isinstance(outcome, list) or not any("layers" in problem for problem in outcome):
            chosen = layers
            break
    flags["--num-layers"] = original
    shrink.set("--num-layers", chosen)


def _world_size(flags: dict) -> int:
    model = (_int(flags, "--tensor-model-parallel-size", 1) * _int(flags, "--pipeline-model-parallel-size", 1)
             * _int(flags, "--context-parallel-size", 1))
    experts = (_int(flags, "--expert-tensor-parallel-size", _int(flags, "--tensor-model-parallel-size", 1))
               * _int(flags, "--expert-model-parallel-size", 1) * _int(flags, "--pipeline-model-parallel-size", 1))
    needed = math.lcm(model, experts)
    return CI_WORLD_SIZE if CI_WORLD_SIZE % needed == 0 else needed


def _moe_layer_pattern(flags: dict) -> list | None:
    """The per-layer 0/1 list of a --moe-layer-freq list expression, e.g. "([0]*3+[1]*12)", else None."""
    from megatron.training.config.moe import parse_layer_freq

    pattern = parse_layer_freq(flags.get("--moe-layer-freq", ["1"])[0])
    return pattern if isinstance(pattern, list) else None


def _cpu(flags: dict) -> dict:
    """The one-rank run's edits: sizes 1, multi-rank flags dropped, two microbatches per step (a step schedule:
    its batches at data-parallel size 1); a --moe-layer-freq list, which fixes 13 to 16 layers for the pipeline
    split, becomes two layers: its first dense and its first MoE layer."""
    edits = {flag: ["1"] for flag in CPU_SIZES if flag in flags}
    edits.update({flag: None for flag in CPU_DROPPED if flag in flags})
    pattern = _moe_layer_pattern(flags)
    if pattern is not None and len(pattern) > 2:
        kinds = sorted(set(pattern)) if len(set(pattern)) == 2 else [pattern[0]] * 2
        edits["--num-layers"] = ["2"]
        edits["--moe-layer-freq"] = [f"([{kinds[0]}]*1+[{kinds[1]}]*1)"]
    small = _int(flags, "--micro-batch-size", 1)
    if "--step-batch-size-schedule" in flags:  # it replaces --global-batch-size
        schedule, samples = _step_schedule(flags, small)
        edits["--step-batch-size-schedule"] = [schedule]
        if "--train-samples" in flags:
            edits["--train-samples"] = [str(samples)]
    else:
        edits["--global-batch-size"] = [str(2 * small)]
        if "--train-samples" in flags:
            edits["--train-samples"] = [str(6 * small)]
    if "--eval-global-batch-size" in flags:
        edits["--eval-global-batch-size"] = [str(_int(flags, "--eval-micro-batch-size", small))]
    return edits


def entry(name: str, config: dict) -> dict:
    flags = as_dict(launcher_argv(config["MODEL_ARGS"]))
    world_size = _world_size(flags)
    shrink = _Shrink(flags)
    _shape(shrink)
    _batch(shrink, world_size)
    _data(shrink)
    _layers(shrink, world_size)
    argv = as_argv(shrink.flags)
    outcome = validation_outcome(argv, world_size)
    return {"name": name, "test_type": config.get("TEST_TYPE"), "world_size": world_size, "argv": argv,
            "changes": shrink.changes, "cpu": _cpu(shrink.flags), "expect": "train" if outcome == "valid" else outcome}


def _trained_flags(e: dict) -> set:
    """The flags of an entry that its one-rank CPU run keeps (the dropped ones are only validated)."""
    return {flag for flag in as_dict(e["argv"]) if e["cpu"].get(flag, []) is not None}


def pick_ci_subset(entries: list[dict]) -> None:
    """Marks the fewest trainable entries (greedy, in file order on ties) that together hold every flag that
    the one-rank run of some trainable entry keeps."""
    trainable = [e for e in entries if e["expect"] == "train"]
    missing = set().union(*(_trained_flags(e) for e in trainable)) if trainable else set()
    for e in entries:
        e["ci"] = False
    while missing:
        best = max(trainable, key=lambda e: len(missing & _trained_flags(e)))
        best["ci"] = True
        missing -= _trained_flags(best)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="Megatron-LM's git repository (a clone or a bare one)")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--output", required=True)
    parser.add_argument("--train-all", action="store_true",
                        help="also train every trainable configuration here and report the failures")
    args = parser.parse_args(argv)
    commit = _git(args.repo, "rev-parse", args.commit).strip()
    entries = [entry(name, config) for name, config in read_configs(args.repo, commit)]
    pick_ci_subset(entries)
    with open(args.output, "w") as file:
        file.write('{"source": ' + json.dumps({"repository": "NVIDIA/Megatron-LM", "commit": commit}) + ',\n')
        file.write(' "configs": [\n  ' + ",\n  ".join(json.dumps(e) for e in entries) + "\n]}\n")
    trained = sum(e["expect"] == "train" for e in entries)
    print(f"{len(entries)} configurations: {trained} validate, {len(entries) - trained} refused; "
          f"{sum(e['ci'] for e in entries)} trained in CI")
    if args.train_all:
        failures = train_all(entries)
        print(f"{trained - len(failures)} of {trained} trained 3 iterations on the CPU")
        for name, error in failures:
            print(f"  {name}: {error}")


def train_all(entries: list[dict]) -> list[tuple[str, str]]:
    """(name, error) of each trainable entry whose one-rank CPU run fails."""
    failures = []
    for e in entries:
        if e["expect"] != "train":
            continue
        with tempfile.TemporaryDirectory() as scratch:
            argv = cpu_command(e, scratch)
            try:
                train_in_process(argv)
            except SystemExit as stop:
                # The re-run engine's exits for an error injected at random (--error-injection-rate): 16 or 17,
                # as Megatron-LM's; any other exit is a failure.
                if not ("--error-injection-rate" in argv and stop.code in (16, 17)):
                    failures.append((e["name"], f"SystemExit: {stop.code}"))
            except Exception as error:  # reported, with the others
                failures.append((e["name"], f"{type(error).__name__}: {str(error)[:300]}"))
    return failures


if __name__ == "__main__":
    main()
