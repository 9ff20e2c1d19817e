"""A crash while saving never leaves a half-written file under a final name, nor a tracker that names an
incomplete iteration; damaged files give messages that name them."""

import os

import pytest
import torch

from megatron.training.checkpointing import files, latest
from megatron.training.checkpointing import load_checkpoint, read_metadata, save_checkpoint
from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args, model_state

pytestmark = pytest.mark.usefixtures("single_rank")


class Crash(Exception):
    """Stands for the process dying."""


def _tracker(directory) -> str:
    return os.path.join(directory, "latest_checkpointed_iteration.txt")


def _all_files(directory) -> list:
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, _, names in os.walk(directory) for name in names)


@pytest.fixture
def saved_at_2(tmp_path):
    """A run with a complete checkpoint at iteration 2."""
    args = make_args("--save", tmp_path, "--load", tmp_path)
    model, optimizer, scheduler = build_run(args, seed=1)
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    return args, model, optimizer, scheduler


def test_files_get_the_mode_a_plain_open_gives(saved_at_2):
    args = saved_at_2[0]
    umask = os.umask(0)
    os.umask(umask)
    for name in _all_files(args.save):
        assert os.stat(os.path.join(args.save, name)).st_mode & 0o777 == 0o666 & ~umask, name


def test_crash_between_model_file_and_tracker_keeps_the_previous_latest(saved_at_2, monkeypatch):
    args, model, optimizer, scheduler = saved_at_2
    saved_params = model_state(model)

    def crash(text, filename):
        raise Crash

    monkeypatch.setattr(latest, "write_text_atomically", crash)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    with pytest.raises(Crash):
        save_checkpoint(4, [model], optimizer, scheduler, 0.0, args=args)
    assert os.path.isfile(os.path.join(args.save, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"))
    assert read_metadata(_tracker(args.save)) == (2, False)

    fresh_args = make_args("--load", args.save)
    fresh_model, fresh_optimizer, fresh_scheduler = build_run(fresh_args, seed=2)
    assert load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=fresh_args)[0] == 2
    for name, tensor in model_state(fresh_model).items():
        assert torch.equal(tensor, saved_params[name]), name


def test_crash_while_writing_the_model_file_leaves_no_file_under_its_final_name(saved_at_2, monkeypatch):
    args, model, optimizer, scheduler = saved_at_2
    real_save = torch.save

    def crash_half_way(obj, file):
        real_save(obj, file)
        file.truncate(file.tell() // 2)
        raise Crash

    monkeypatch.setattr(files.torch, "save", crash_half_way)
    with pytest.raises(Crash):
        save_checkpoint(4, [model], optimizer, scheduler, 0.0, args=args)
    # The temporary file is removed and the previous checkpoint is untouched and still "latest".
    assert _all_files(args.save) == ["iter_0000002/mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"]
    assert read_metadata(_tracker(args.save)) == (2, False)


def test_crash_before_the_tracker_rename_keeps_the_old_tracker(saved_at_2, monkeypatch):
    args, model, optimizer, scheduler = saved_at_2
    real_replace = os.replace

    def crash_on_tracker(source, target):
        if target == _tracker(args.save):
            raise Crash
        real_replace(source, target)

    monkeypatch.setattr(files.os, "replace", crash_on_tracker)
    with pytest.raises(Crash):
        save_checkpoint(4, [model], optimizer, scheduler, 0.0, args=args)
    assert read_metadata(_tracker(args.save)) == (2, False)
    assert _all_files(args.save) == [
        "iter_0000002/mp_rank_00/model_optim_rng.pt",
        "iter_0000004/mp_rank_00/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt",
    ]


@pytest.mark.parametrize("kept_fraction", [0.0, 0.3, 0.99])
def test_truncated_checkpoint_file_names_the_file(saved_at_2, kept_fraction):
    args, model, optimizer, scheduler = saved_at_2
    checkpoint_file = os.path.join(args.save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    with open(checkpoint_file, "r+b") as file:
        file.truncate(int(os.path.getsize(checkpoint_file) * kept_fraction))
    with pytest.raises(ValueError, match="corrupt or truncated") as error:
        load_checkpoint([model], optimizer, scheduler, args=make_args("--load", args.save))
    assert checkpoint_file in str(error.value) and "--ckpt-step" in str(error.value)


def test_missing_rank_file_lists_what_the_iteration_holds(saved_at_2):
    args, model, optimizer, scheduler = saved_at_2
    iteration_dir = os.path.join(args.save, "iter_0000002")
    os.rename(os.path.join(iteration_dir, "mp_rank_00"), os.path.join(iteration_dir, "mp_rank_00_000"))
    with pytest.raises(FileNotFoundError) as error:
        load_checkpoint([model], optimizer, scheduler, args=make_args("--load", args.save))
    message = str(error.value)
    assert os.path.join(iteration_dir, "mp_rank_00", "model_optim_rng.pt") in message
    assert "holds mp_rank_00_000" in message and "parallel layout" in message


def test_corrupt_tracker_stops_the_load_with_its_name(saved_at_2):
    args, model, optimizer, scheduler = saved_at_2
    with open(_tracker(args.save), "w") as file:
        file.write("garbage")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt is corrupt: it holds 'garbage'"):
        load_checkpoint([model], optimizer, scheduler, args=make_args("--load", args.save))
