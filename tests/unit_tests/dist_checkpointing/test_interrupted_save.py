"""A save killed midway (the writer process dies after a few tensors, as on a preemption or a node
failure) never becomes "latest": the previous checkpoint stays in the tracker and loads; the half-written
iteration is refused by name. Both for a save in the training thread and for --async-save's thread."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import dcp_planners
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.dist_utils import fresh_process_context
from tests.unit_tests.training.checkpointing.tiny_run import assert_same, build_run, make_args, model_state, train_steps

KILLED = 17


def _save_then_die_while_saving(directory: str, async_save: bool) -> None:
    """Child process: saves iteration 1, then dies after writing 3 tensors of iteration 2."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    os.makedirs(directory)
    flags = ["--ckpt-format", "torch_dist", "--save", directory] + (["--async-save"] if async_save else [])
    args = make_args(*flags)
    model, optimizer, scheduler = build_run(args, 1234)
    train_steps(model, optimizer, scheduler, args, 0, 1)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
    if async_save:
        from megatron.training.checkpointing.dist_saving import finalize_async_save

        finalize_async_save()
    torch.save(model_state(model), os.path.join(directory, "saved_at_1.pt"))
    train_steps(model, optimizer, scheduler, args, 1, 1)

    resolve_data, written = dcp_planners.ShardedSavePlanner.resolve_data, []

    def die_after_three(self, write_item):
        if len(written) == 3:
            os._exit(KILLED)
        written.append(write_item)
        return resolve_data(self, write_item)

    dcp_planners.ShardedSavePlanner.resolve_data = die_after_three
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    if async_save:
        finalize_async_save()
    os._exit(0)  # not reached: the writer died first


def test_killed_save_leaves_the_previous_checkpoint_latest(tmp_path, single_rank):
    context = fresh_process_context()
    children = {mode: context.Process(target=_save_then_die_while_saving, args=(str(tmp_path / mode), mode == "async"))
                for mode in ("sync", "async")}
    for child in children.values():
        child.start()
    for child in children.values():
        child.join(timeout=120)
    for mode, child in children.items():
        directory = tmp_path / mode
        assert child.exitcode == KILLED, mode
        assert (directory / "latest_checkpointed_iteration.txt").read_text() == "1", mode
        assert not (directory / "iter_0000002" / "metadata.json").exists(), mode

        args = make_args("--ckpt-format", "torch_dist", "--load", directory)
        model, optimizer, scheduler = build_run(args, 99)
        assert load_checkpoint([model], optimizer, scheduler, args=args)[0] == 1, mode
        assert_same(model_state(model), torch.load(directory / "saved_at_1.pt"), mode)

        args = make_args("--ckpt-format", "torch_dist", "--load", directory, "--ckpt-step", "2")
        with pytest.raises(ValueError, match="iter_0000002 is an incompletely written distributed checkpoint"):
            load_checkpoint([model], optimizer, scheduler, args=args)
