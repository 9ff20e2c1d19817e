"""Resuming skips a checkpoint that fails its integrity check and takes the newest older one that loads."""

import os

import pytest
import torch

from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args, model_state

pytestmark = pytest.mark.usefixtures("single_rank")


def _file(directory, iteration):
    return os.path.join(directory, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")


@pytest.fixture
def saved_at_2_and_4(tmp_path):
    """Checkpoints at iterations 2 and 4 holding different weights; the weights of 2 are returned."""
    args = make_args("--save", tmp_path, "--load", tmp_path)
    model, optimizer, scheduler = build_run(args, seed=1)
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    weights_at_2 = model_state(model)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    save_checkpoint(4, [model], optimizer, scheduler, 0.0, args=args)
    return args, weights_at_2


def _load(directory, *flags):
    args = make_args("--load", directory, *flags)
    model, optimizer, scheduler = build_run(args, seed=2)
    iteration, _ = load_checkpoint([model], optimizer, scheduler, args=args)
    return iteration, model_state(model)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(saved_at_2_and_4, damage, capsys):
    args, weights_at_2 = saved_at_2_and_4
    latest = _file(args.save, 4)
    if damage == "truncate":
        with open(latest, "r+b") as file:
            file.truncate(os.path.getsize(latest) // 3)
    else:
        os.remove(latest)
    iteration, weights = _load(args.save)
    assert iteration == 2
    for name, tensor in weights.items():
        assert torch.equal(tensor, weights_at_2[name]), name
    printed = capsys.readouterr().out
    assert "checkpoint iteration 4" in printed and "damaged on rank(s) [0]" in printed
    assert "resuming from iteration 2 instead of 4" in printed


def test_explicit_ckpt_step_never_falls_back(saved_at_2_and_4):
    args, _ = saved_at_2_and_4
    with open(_file(args.save, 4), "r+b") as file:
        file.truncate(100)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        _load(args.save, "--ckpt-step", 4)


def test_every_checkpoint_damaged_raises_the_latest_ones_error(saved_at_2_and_4):
    args, _ = saved_at_2_and_4
    for iteration in (2, 4):
        with open(_file(args.save, iteration), "r+b") as file:
            file.truncate(100)
    with pytest.raises(ValueError, match="iter_0000004.*corrupt or truncated"):
        _load(args.save)


def test_auto_resume_loads_from_the_save_directory(saved_at_2_and_4):
    args, _ = saved_at_2_and_4
    resumed = make_args("--save", args.save, "--auto-resume")
    assert resumed.load == args.save
    with pytest.raises(ValueError, match="--auto-resume resumes from --save: give --save DIR"):
        make_args("--auto-resume")
