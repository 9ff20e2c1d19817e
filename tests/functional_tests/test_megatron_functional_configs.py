"""Megatron-LM's own GPT and MoE functional-test configurations run here
(tests/fixtures/megatron_functional/configs.json, written by tools/megatron_interop/functional_configs.py,
whose docstring says how each command line was made tiny).

Every configuration is validated at its parallel layout and world size: accepted, or refused with exactly
the reason the file records. The configurations marked `ci` (the fewest that together hold every flag of the
accepted ones) also train their 3 iterations on one CPU rank, in this process, one after the other;
`python tools/megatron_interop/functional_configs.py --train-all` trains all of them.
"""

import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools", "megatron_interop"))

from functional_runs import cpu_command, train_in_process, validation_outcome  # noqa: E402

with open(os.path.join(ROOT, "tests", "fixtures", "megatron_functional", "configs.json")) as _file:
    CONFIGS = json.load(_file)["configs"]


@pytest.mark.parametrize("entry", CONFIGS, ids=[entry["name"] for entry in CONFIGS])
def test_validated_or_refused_as_recorded(entry):
    # Validation opens no file: the command line is checked with its path placeholders, as the file was made.
    expected = "valid" if entry["expect"] == "train" else entry["expect"]
    assert validation_outcome(entry["argv"], entry["world_size"]) == expected


def test_at_least_nine_in_ten_configurations_are_accepted():
    """The issue's bar: >= 90% of Megatron-LM's GPT and MoE configurations validate and train (the rest are
    refused with a named reason, `test_validated_or_refused_as_recorded`)."""
    accepted = sum(entry["expect"] == "train" for entry in CONFIGS)
    assert accepted >= 0.9 * len(CONFIGS), f"{accepted} of {len(CONFIGS)}"


_TRAINED = [entry for entry in CONFIGS if entry["ci"]]


@pytest.mark.parametrize("entry", _TRAINED, ids=[entry["name"] for entry in _TRAINED])
def test_trains_on_one_cpu_rank(entry, tmp_path):
    argv = cpu_command(entry, str(tmp_path))
    flags = dict(zip(argv, argv[1:]))
    try:
        args = train_in_process(argv)
    except SystemExit as stop:
        # An error injected by --error-injection-rate (at random, the rate being > 1) stops the run as
        # Megatron-LM's re-run engine does: 16 after saving the state before the iteration, or 17.
        assert "--error-injection-rate" in flags and stop.code in (16, 17), stop.code
        latest = tmp_path / "save" / "latest_checkpointed_iteration.txt"
        assert latest.exists() == (stop.code == 16)
        return
    samples = int(flags["--train-samples"]) if "--train-samples" in flags else 3 * int(flags["--global-batch-size"])
    exit_interval = int(flags.get("--exit-interval", 10**9))
    assert args.consumed_train_samples == samples * min(exit_interval, 3) // 3
