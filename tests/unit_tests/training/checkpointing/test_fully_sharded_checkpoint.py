"""torch_dist checkpoints of an FSDP2 run (--use-torch-fsdp2 --bf16, 2 gloo ranks): exact resume, and resharding
to and from other layouts (TP=2 at DP=1, and one process) through the DDP checkpoint layout.

Every rank trains on the same batches, so data parallelism changes no value: a layout change shows only as
rounding (TP splits the GEMMs; the gradient norm is summed over other pieces), measured at 1.4e-5 relative on
the losses after the load (asserted: 1e-4). A checkpoint that goes through another layout untouched resumes
bit for bit. Megatron-FSDP's optim_grads_params (ZeRO-3 on DDP's buffers) does all this too, and optim_grads
(ZeRO-2 on the distributed optimizer) resumes bit for bit.
"""

import os

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.checkpointing.tiny_run import BATCH_SIZE, build_run, make_args, train_steps

FLAGS = ("--bf16", "--ckpt-format", "torch_dist", "--hidden-dropout", "0", "--attention-dropout", "0")
SAVED_AT = 2


def _full_weights(model) -> dict:
    model.start_param_sync(force_sync=True)  # ZeRO-3: every param whole
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).float().clone()
            for name, value in model.state_dict().items() if torch.is_tensor(value)}


def _resume(args, directory: str, seed: int):
    """(losses of steps 2 and 3, full weights) of a run built from `seed` that loads `directory`."""
    args.load = directory
    model, optimizer, scheduler = build_run(args, seed)
    load_checkpoint([model], optimizer, scheduler, args=args)
    return model, optimizer, scheduler


def _layouts(rank, world_size, directory, fsdp_args, tensor_parallel_args):
    init_num_microbatches_calculator(rank, None, BATCH_SIZE * world_size, BATCH_SIZE, world_size)
    parallel_state.initialize_model_parallel()
    fsdp_args.save = os.path.join(directory, "fsdp")
    model, optimizer, scheduler = build_run(fsdp_args, seed=1234)
    train_steps(model, optimizer, scheduler, fsdp_args, 0, SAVED_AT)
    save_checkpoint(SAVED_AT, [model], optimizer, scheduler, 0.0, args=fsdp_args)
    straight = train_steps(model, optimizer, scheduler, fsdp_args, SAVED_AT, 2), _full_weights(model)

    fsdp_args.consumed_train_samples = 0
    model, optimizer, scheduler = _resume(fsdp_args, fsdp_args.save, seed=77)
    resumed = train_steps(model, optimizer, scheduler, fsdp_args, SAVED_AT, 2), _full_weights(model)

    # TP=2 at DP=1 (DDP layout) loads it, saves it again untouched, and trains on.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel_args.save = os.path.join(directory, "tp2")
    model, optimizer, scheduler = _resume(tensor_parallel_args, fsdp_args.save, seed=77)
    save_checkpoint(SAVED_AT, [model], optimizer, scheduler, 0.0, args=tensor_parallel_args)
    tensor_parallel = train_steps(model, optimizer, scheduler, tensor_parallel_args, SAVED_AT, 2)

    # FSDP=2 from that TP=2 checkpoint: the same state as from its own.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    model, optimizer, scheduler = _resume(fsdp_args, tensor_parallel_args.save, seed=77)
    round_trip = train_steps(model, optimizer, scheduler, fsdp_args, SAVED_AT, 2), _full_weights(model)
    return straight, resumed, tensor_parallel, round_trip


@pytest.mark.parametrize("fsdp_flags", [("--use-torch-fsdp2",),
                                        ("--use-megatron-fsdp", "--dist-ckpt-optim-fully-reshardable")])
def test_fsdp_checkpoint_resumes_exactly_and_reshards(tmp_path, monkeypatch, single_rank, fsdp_flags):
    """FSDP2, and Megatron-FSDP's optim_grads_params (ZeRO-3 on DDP's buffers: saved from and loaded into each
    rank's bf16 param shard and the distributed optimizer's fp32 main shards, whose state reshards in the layout
    of --dist-ckpt-optim-fully-reshardable)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    fsdp_args = make_args(*FLAGS, *fsdp_flags, "--global-batch-size", 2 * BATCH_SIZE)
    tensor_parallel_args = make_args(*FLAGS, "--tensor-model-parallel-size", "2")
    monkeypatch.delenv("WORLD_SIZE")
    results = run_distributed(_layouts, 2, str(tmp_path), fsdp_args, tensor_parallel_args)
    (straight_losses, straight_weights), resumed, tensor_parallel, round_trip = results[0]
    assert all(result[0][0] == straight_losses for result in results)
    for name, (losses, weights) in {"resumed": resumed, "round trip through TP=2": round_trip}.items():
        assert losses == straight_losses, name
        assert weights.keys() == straight_weights.keys()
        for key, value in weights.items():
            assert torch.equal(value, straight_weights[key]), f"{name}: {key}"
    torch.testing.assert_close(tensor_parallel, straight_losses, rtol=1e-4, atol=0)

    # One process, no FSDP, loads what FSDP=2 saved.
    args = make_args(*FLAGS)
    model, optimizer, scheduler = _resume(args, str(tmp_path / "fsdp"), seed=77)
    single = train_steps(model, optimizer, scheduler, args, SAVED_AT, 2)
    torch.testing.assert_close(single, straight_losses, rtol=1e-4, atol=0)


def _zero2_resume(rank, world_size, directory, args):
    init_num_microbatches_calculator(rank, None, BATCH_SIZE * world_size, BATCH_SIZE, world_size)
    parallel_state.initialize_model_parallel()
    args.save = directory
    model, optimizer, scheduler = build_run(args, seed=1234)
    train_steps(model, optimizer, scheduler, args, 0, SAVED_AT)
    save_checkpoint(SAVED_AT, [model], optimizer, scheduler, 0.0, args=args)
    straight = train_steps(model, optimizer, scheduler, args, SAVED_AT, 2), _full_weights(model)
    args.consumed_train_samples = 0
    model, optimizer, scheduler = _resume(args, directory, seed=77)
    return straight, (train_steps(model, optimizer, scheduler, args, SAVED_AT, 2), _full_weights(model))


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_megatron_fsdp_sharded_gradients_resume_exactly(tmp_path, monkeypatch, single_rank, strategy):
    """ZeRO-2 and ZeRO-3 (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads / optim_grads_params:
    the distributed optimizer's checkpoint code, in its default bucket layout, over sharded gradients and params)
    resume bit for bit from torch_dist."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = make_args(*FLAGS, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                     "--global-batch-size", 2 * BATCH_SIZE)
    monkeypatch.delenv("WORLD_SIZE")
    for (straight_losses, straight_weights), (losses, weights) in run_distributed(_zero2_resume, 2, str(tmp_path),
                                                                                  args):
        assert losses == straight_losses
        for key, value in weights.items():
            assert torch.equal(value, straight_weights[key]), key
