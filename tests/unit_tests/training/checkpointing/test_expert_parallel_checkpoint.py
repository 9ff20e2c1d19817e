"""Torch-format checkpoints of a MoE model (4 experts, top-2) with the distributed optimizer under expert
parallelism on 4 gloo ranks, and expert TP below TP: every rank's `mp_rank_TT_EEE` file is written by
exactly one rank, the chained optimizer's `distrib_optim.pt` by the rank 0s of its two data-parallel
groups (DP x CP for dense params, expert-DP for experts), and a run resumed from them continues bit for
bit (losses and every parameter after one more step).

    layout (TP, expert TP, EP)   dense DP  expert DP   what it exercises
    (1, 1, 2)                    4         2           rank 1 is an expert-DP rank 0 but no DP rank 0
    (2, 1, 4)                    2         1           ranks 2, 3 likewise, with expert TP 1 under TP 2
    (4, 1, 2)                    1         2           ranks 2, 3 hold (TP, EP) pairs no expert-DP rank 0
                                                       has: Megatron-LM's writers would skip their files
"""

import os

import torch

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.training.checkpointing import distrib_optim, saving
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from tests.unit_tests.dist_checkpointing.tiny_gpt import GLOBAL_BATCH, build, train_step
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.checkpointing.tiny_run import make_args

LAYOUTS = [(1, 1, 2), (2, 1, 4), (4, 1, 2)]


def _params(ddp) -> list:
    ddp.start_param_sync(force_sync=True)
    return [param.detach().clone() for param in ddp.module.parameters()]


def _recording_writes(module, writes: list):
    real = module.save_atomically
    module.save_atomically = lambda obj, filename: (writes.append(filename), real(obj, filename))
    return real


def _resume_checks(rank, world_size, directory, args):
    init_num_microbatches_calculator(rank, None, GLOBAL_BATCH, 2, world_size)
    results = []
    for tensor_parallel, expert_tensor_parallel, expert_parallel in LAYOUTS:
        args.save = args.load = os.path.join(directory, f"tp{tensor_parallel}_etp{expert_tensor_parallel}_ep"
                                             f"{expert_parallel}")
        layout = dict(expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel)
        ddp, optimizer = build(tensor_parallel, 1, True, seed=1, **layout)
        for step in range(2):
            train_step(ddp, optimizer, step)
        writes = []
        real = [_recording_writes(module, writes) for module in (saving, distrib_optim)]
        try:
            save_checkpoint(2, [ddp], optimizer, None, 0.0, args=args)
        finally:
            saving.save_atomically, distrib_optim.save_atomically = real
        fresh_ddp, fresh_optimizer = build(tensor_parallel, 1, True, seed=7, **layout)
        load_checkpoint([fresh_ddp], fresh_optimizer, None, args=args)
        losses = (train_step(ddp, optimizer, 2), train_step(fresh_ddp, fresh_optimizer, 2))
        same = all(torch.equal(a, b) for a, b in zip(_params(ddp), _params(fresh_ddp)))
        mine = os.path.relpath(os.path.dirname(saving.get_checkpoint_name(args.save, 2)), args.save)
        results.append((mine, [os.path.relpath(name, args.save) for name in writes], losses, same))
    parallel_state.destroy_model_parallel()
    return results


def test_distributed_optimizer_checkpoints_under_expert_parallelism_resume_exactly(tmp_path):
    args = make_args("--use-distributed-optimizer", "--ckpt-format", "torch")
    per_rank = run_distributed(_resume_checks, 4, str(tmp_path), args)
    for index, layout in enumerate(LAYOUTS):
        ranks = [per_rank[rank][index] for rank in range(4)]
        directories = {mine for mine, _, _, _ in ranks}
        writes = [name for _, names, _, _ in ranks for name in names]
        model_files = sorted(name for name in writes if name.endswith("model_optim_rng.pt"))
        optimizer_files = sorted(name for name in writes if name.endswith("distrib_optim.pt"))
        assert model_files == sorted(f"{mine}/model_optim_rng.pt" for mine in directories), (layout, writes)
        assert optimizer_files == sorted(set(optimizer_files)), (layout, optimizer_files)
        for mine, _, (loss, resumed_loss), same in ranks:
            assert f"{mine}/distrib_optim.pt" in optimizer_files, (layout, mine)
            assert loss == resumed_loss and same, layout
    # (1, 1, 2): dense DP rank 0 is rank 0 (directory EP 0), expert-DP rank 0s are ranks 0 and 1.
    assert sorted(per_rank[1][0][1]) == [
        "iter_0000002/mp_rank_00_001/distrib_optim.pt", "iter_0000002/mp_rank_00_001/model_optim_rng.pt"]
