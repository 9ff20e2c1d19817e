"""TrainState: its round trips (state_dict, and a checkpoint written and read back: Megatron's keys, the
counters inside `args`), and the counters of a checkpoint written by the real Megatron-LM."""

import os

import pytest

from megatron.training.batch_plan import BatchPlan
from megatron.training.checkpointing.files import load_checkpoint_file
from megatron.training.checkpointing.loading import load_train_state
from megatron.training.checkpointing.saving import save_checkpoint
from megatron.training.train_state import TrainState
from tests.unit_tests.training.checkpointing.tiny_run import BATCH_SIZE, build_run, make_args

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
MEGATRON_CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "megatron_lm", "gpu1", "megatron", "torch-fp32-adam-tp1",
                                   "checkpoint")
# Megatron-LM's run (runs.json): --micro-batch-size 2 --global-batch-size 8 on one rank.
PLAN_OF_8 = BatchPlan(micro_batch_size=2, data_parallel_size=1, global_batch_size=8)


def test_state_dict_round_trip():
    state = TrainState(iteration=7, consumed_train_samples=56, skipped_train_samples=3, consumed_valid_samples=16,
                       num_floating_point_operations_so_far=1.5e12)
    copy = TrainState()
    copy.load_state_dict(state.state_dict())
    assert copy == state
    assert set(state.state_dict()) == {"iteration", "consumed_train_samples", "skipped_train_samples",
                                       "consumed_valid_samples", "num_floating_point_operations_so_far"}
    with pytest.raises(KeyError, match="train state without consumed_valid_samples"):
        copy.load_state_dict({key: value for key, value in state.state_dict().items()
                              if key != "consumed_valid_samples"})


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_checkpoint_round_trip_in_megatrons_keys(tmp_path, ckpt_format):
    args = make_args("--save", tmp_path, "--load", tmp_path, "--ckpt-format", ckpt_format)
    model, optimizer, scheduler = build_run(args, 1234)
    state = TrainState(iteration=3, consumed_train_samples=3 * BATCH_SIZE, skipped_train_samples=1,
                       consumed_valid_samples=8, num_floating_point_operations_so_far=2.5e9)
    state.publish(args)
    save_checkpoint(state.iteration, [model], optimizer, scheduler, state.num_floating_point_operations_so_far,
                    args=args)
    if ckpt_format == "torch":
        saved = load_checkpoint_file(os.path.join(tmp_path, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"))
        assert (saved["iteration"], saved["num_floating_point_operations_so_far"]) == (3, 2.5e9)
        assert (saved["args"].consumed_train_samples, saved["args"].skipped_train_samples,
                saved["args"].consumed_valid_samples) == (3 * BATCH_SIZE, 1, 8)
    fresh_args = make_args("--save", tmp_path, "--load", tmp_path, "--ckpt-format", ckpt_format)
    model, optimizer, scheduler = build_run(fresh_args, 99)
    assert load_train_state([model], optimizer, scheduler, fresh_args) == state


def test_megatron_lm_checkpoint_counters():
    # Megatron-LM's run (runs.json): --global-batch-size 8, saved at iteration 10, no evaluation before it.
    saved = load_checkpoint_file(os.path.join(MEGATRON_CHECKPOINT, "iter_0000010", "mp_rank_00", "model_optim_rng.pt"))
    state = TrainState.from_checkpoint(saved, 10, plan=PLAN_OF_8)
    assert state.state_dict() == {"iteration": 10, "consumed_train_samples": 80, "skipped_train_samples": 0,
                                  "consumed_valid_samples": 0,
                                  "num_floating_point_operations_so_far": saved["num_floating_point_operations_so_far"]}
    assert TrainState.from_checkpoint(saved, 0, plan=PLAN_OF_8, restore_counters=False) == TrainState(
        num_floating_point_operations_so_far=saved["num_floating_point_operations_so_far"])


def test_checkpoints_before_the_counters_consumed_iteration_times_global_batch():
    assert TrainState.from_checkpoint({"iteration": 5}, 5, plan=PLAN_OF_8).consumed_train_samples == 40
    zero = type("Args", (), {"consumed_train_samples": 0})()
    assert TrainState.from_checkpoint({"args": zero}, 5, plan=PLAN_OF_8).consumed_train_samples == 40
