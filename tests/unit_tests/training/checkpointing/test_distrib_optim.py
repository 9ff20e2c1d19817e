"""--use-distributed-optimizer checkpoints on two data-parallel ranks (gloo): DP rank 0 writes distrib_optim.pt
beside model_optim_rng.pt, a resumed optimizer continues bit for bit, and a missing or mismatched optimizer
state fails on every rank with a message instead of leaving the others waiting."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.training.checkpointing import distrib_optim
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.optimizer.test_distrib_optimizer import build, params, train
from tests.unit_tests.training.checkpointing.tiny_run import BATCH_SIZE, make_args, seed_everything

OVERLAP = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300)


def _checkpoint_checks(rank, world_size, directory, args, plain_args):
    parallel_state.initialize_model_parallel()
    init_num_microbatches_calculator(rank, None, 2 * BATCH_SIZE, BATCH_SIZE, world_size)
    seed_everything(1234)  # the RNG tracker a checkpoint saves
    ddp, optimizer = build(torch.bfloat16, 1.0, **OVERLAP)
    train(ddp, optimizer, steps=2)

    writes = []
    real_save = distrib_optim.save_atomically
    distrib_optim.save_atomically = lambda obj, filename: (writes.append(filename), real_save(obj, filename))
    try:
        save_checkpoint(2, [ddp], optimizer, None, 0.0, args=args)  # params still await their all-gather
    finally:
        distrib_optim.save_atomically = real_save

    fresh_ddp, fresh_optimizer = build(torch.bfloat16, 1.0, seed=9, **OVERLAP)
    load_checkpoint([fresh_ddp], fresh_optimizer, None, args=args)
    train(ddp, optimizer, steps=2, first_step=2)
    train(fresh_ddp, fresh_optimizer, steps=2, first_step=2)
    continues_exactly = all(torch.equal(a, b) for a, b in zip(params(fresh_ddp), params(ddp)))

    plain_ddp, plain_optimizer = build(torch.bfloat16, 1.0, distributed=False)
    with pytest.raises(ValueError, match="saved with the distributed optimizer.*--no-load-optim"):
        load_checkpoint([plain_ddp], plain_optimizer, None, args=plain_args)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(directory, "iter_0000002", "mp_rank_00", "distrib_optim.pt"))
    dist.barrier()
    with pytest.raises(ValueError, match="distrib_optim.pt does not exist.*--no-load-optim"):
        load_checkpoint([fresh_ddp], fresh_optimizer, None, args=args)
    return [os.path.relpath(name, directory) for name in writes], continues_exactly


def test_distributed_optimizer_checkpoint_on_two_ranks(tmp_path):
    args = make_args("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16")
    plain_args = make_args("--bf16")
    for run_args in (args, plain_args):
        run_args.save = run_args.load = str(tmp_path)
    results = run_distributed(_checkpoint_checks, 2, str(tmp_path), args, plain_args)
    assert [writes for writes, _ in results] == [["iter_0000002/mp_rank_00/distrib_optim.pt"], []]
    assert all(continues_exactly for _, continues_exactly in results)
