"""Checkpoint names and the tracker file, against the table of reference 8.1."""

import os

import pytest

from megatron.training.checkpointing import (
    checkpoint_exists,
    find_checkpoint_rank_0,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    read_metadata,
)


@pytest.mark.parametrize(
    "pipeline_parallel, expert_parallel, expected",
    [
        (False, False, "iter_0000100/mp_rank_03/model_optim_rng.pt"),
        (True, False, "iter_0000100/mp_rank_03_002/model_optim_rng.pt"),
        (False, True, "iter_0000100/mp_rank_03_005/model_optim_rng.pt"),
        (True, True, "iter_0000100/mp_rank_03_002_005/model_optim_rng.pt"),
    ],
)
def test_names_for_every_parallel_combination(pipeline_parallel, expert_parallel, expected):
    name = get_checkpoint_name(
        "ckpts", 100, pipeline_parallel=pipeline_parallel, tensor_rank=3, pipeline_rank=2,
        expert_parallel=expert_parallel, expert_rank=5,
    )
    assert name == os.path.join("ckpts", expected)


def test_release_base_dir_basename_and_wide_iterations():
    kwargs = dict(pipeline_parallel=False, tensor_rank=0, pipeline_rank=0, expert_parallel=False, expert_rank=0)
    assert get_checkpoint_name("c", 7, release=True, **kwargs) == os.path.join("c", "release", "mp_rank_00",
                                                                              "model_optim_rng.pt")
    assert get_checkpoint_name("c", 7, return_base_dir=True) == os.path.join("c", "iter_0000007")
    assert get_checkpoint_name("c", 12345678, return_base_dir=True) == os.path.join("c", "iter_12345678")
    assert get_checkpoint_name("c", 7, basename="distrib_optim.pt", **kwargs).endswith("mp_rank_00/distrib_optim.pt")
    assert get_checkpoint_tracker_filename("c") == os.path.join("c", "latest_checkpointed_iteration.txt")


def test_defaults_come_from_the_parallel_state_of_a_single_process():
    # No parallel groups: TP rank 0, PP = EP = 1, so neither suffix appears.
    assert get_checkpoint_name("c", 5) == os.path.join("c", "iter_0000005", "mp_rank_00", "model_optim_rng.pt")


@pytest.mark.parametrize("rank_directory", ["mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"])
def test_find_checkpoint_rank_0_whatever_the_layout(tmp_path, rank_directory):
    assert find_checkpoint_rank_0(str(tmp_path), 3) is None
    path = tmp_path / "iter_0000003" / rank_directory / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert find_checkpoint_rank_0(str(tmp_path), 3) == str(path)


@pytest.mark.parametrize("text, expected", [("1000", (1000, False)), ("release\n", (0, True)), (" 42 \n", (42, False))])
def test_read_metadata(tmp_path, text, expected):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text(text)
    assert read_metadata(str(tracker)) == expected
    assert checkpoint_exists(str(tmp_path)) and not checkpoint_exists(str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("text", ["", "iter_0000100", "-3", "10.5", "Release"])
def test_corrupt_tracker_names_the_file_and_its_content(tmp_path, text):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text(text)
    with pytest.raises(ValueError) as error:
        read_metadata(str(tracker))
    assert str(tracker) in str(error.value) and repr(text) in str(error.value)
    assert "'release'" in str(error.value)


def test_save_retain_interval_deletes_the_previous_checkpoint_off_the_interval(tmp_path):
    """--save-interval 5 --save-retain-interval 10: after each save, the one before it goes unless its
    iteration is a multiple of 10 (Megatron-LM's rule); a symbolic link is kept."""
    from megatron.training.checkpointing.latest import name_latest

    save = str(tmp_path)
    for iteration in (5, 10, 15, 20, 25):
        os.makedirs(get_checkpoint_name(save, iteration, return_base_dir=True))
        name_latest(save, iteration, release=False, retain_interval=10)
    assert sorted(os.listdir(save)) == ["iter_0000010", "iter_0000020", "iter_0000025",
                                        "latest_checkpointed_iteration.txt"]
    assert read_metadata(get_checkpoint_tracker_filename(save)) == (25, False)
    os.symlink(tmp_path / "iter_0000010", tmp_path / "iter_0000035")
    name_latest(save, 35, release=False, retain_interval=10)
    os.makedirs(get_checkpoint_name(save, 40, return_base_dir=True))
    name_latest(save, 40, release=False, retain_interval=10)
    assert "iter_0000035" in os.listdir(save) and "iter_0000025" not in os.listdir(save)
    name_latest(save, 45, release=False, retain_interval=None)  # no interval: nothing is deleted
    assert "iter_0000040" in os.listdir(save)
