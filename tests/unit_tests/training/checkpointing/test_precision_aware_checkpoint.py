"""The distributed optimizer with bf16 Adam moments (--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16) through save_checkpoint / load_checkpoint on one rank, in the three layouts of its
state: distrib_optim.pt (--ckpt-format torch), the bucket layout (torch_dist, dp_reshardable) and the model-space
one (--dist-ckpt-optim-fully-reshardable).

A resumed run continues bit for bit (bf16 -> fp32 -> bf16 is exact). The files hold the moments in fp32, as
Megatron-LM's precision-aware optimizer writes them (Transformer Engine's FusedAdam widens them when saving and
rounds them to nearest when loading), so a checkpoint of fp32 moments loads into a bf16-moment run (the moments
rounded) and back (widened)."""

import os

import pytest
import torch

from megatron.core.dist_checkpointing.serialization import saved_tensors
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args, seed_everything, train_steps

pytestmark = pytest.mark.usefixtures("single_rank")

BF16_MOMENTS = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
LAYOUTS = {
    "torch": ("--ckpt-format", "torch"),
    "dp_reshardable": ("--ckpt-format", "torch_dist"),
    "fully_reshardable": ("--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"),
}


def _args(directory, *flags):
    return make_args("--bf16", "--use-distributed-optimizer", "--save", directory, "--load", directory, *flags)


def _moments(optimizer) -> list:
    """Every main shard's (exp_avg, exp_avg_sq), copied."""
    return [tuple(optimizer.optimizer.state[shard][key].clone() for key in ("exp_avg", "exp_avg_sq"))
            for shard in optimizer.main_shards]


def _saved_moment_dtypes(directory, layout) -> set:
    """The dtypes the checkpoint of iteration 2 stores the Adam moments in."""
    iteration = os.path.join(directory, "iter_0000002")
    if layout == "torch":
        state = torch.load(os.path.join(iteration, "mp_rank_00", "distrib_optim.pt"), weights_only=False)
        return {tensors[key].dtype for buffer in state.values() if isinstance(buffer, dict)
                for tensors in buffer.values() for key in ("exp_avg", "exp_avg_sq")}
    return {dtype for key, (_, dtype) in saved_tensors(iteration).items() if "exp_avg" in key}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_moments_resume_exactly(tmp_path, layout):
    args = _args(tmp_path, *LAYOUTS[layout], *BF16_MOMENTS)
    model, optimizer, scheduler = build_run(args, seed=1234)
    train_steps(model, optimizer, scheduler, args, 0, 2)
    saved = _moments(optimizer)
    assert {moment.dtype for pair in saved for moment in pair} == {torch.bfloat16}
    save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    expected = train_steps(model, optimizer, scheduler, args, 2, 2)

    assert _saved_moment_dtypes(tmp_path, layout) == {torch.float32}
    args = _args(tmp_path, *LAYOUTS[layout], *BF16_MOMENTS)
    fresh_model, fresh_optimizer, fresh_scheduler = build_run(args, seed=99)
    seed_everything(7)
    load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=args)
    for loaded, before in zip(_moments(fresh_optimizer), saved):
        assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(loaded, before))
    assert train_steps(fresh_model, fresh_optimizer, fresh_scheduler, args, 2, 2) == expected
    for resumed, straight in zip(fresh_optimizer.main_shards, optimizer.main_shards):
        assert torch.equal(resumed, straight)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_and_bf16_moment_checkpoints_load_into_each_other(tmp_path, layout):
    for saving, loading in ((), BF16_MOMENTS), (BF16_MOMENTS, ()):
        directory = tmp_path / ("from_bf16" if saving else "from_fp32")
        args = _args(directory, *LAYOUTS[layout], *saving)
        model, optimizer, scheduler = build_run(args, seed=1234)
        train_steps(model, optimizer, scheduler, args, 0, 2)
        save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
        assert _saved_moment_dtypes(directory, layout) == {torch.float32}

        args = _args(directory, *LAYOUTS[layout], *loading)
        fresh_model, fresh_optimizer, fresh_scheduler = build_run(args, seed=99)
        load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=args)
        dtype = torch.bfloat16 if loading else torch.float32
        for loaded, before in zip(_moments(fresh_optimizer), _moments(optimizer)):
            # fp32 -> bf16 rounds to nearest even (torch's cast); bf16 -> fp32 is exact
            assert all(a.dtype == dtype and torch.equal(a, b.to(dtype)) for a, b in zip(loaded, before))
        for resumed, straight in zip(fresh_optimizer.main_shards, optimizer.main_shards):
            assert torch.equal(resumed, straight)
