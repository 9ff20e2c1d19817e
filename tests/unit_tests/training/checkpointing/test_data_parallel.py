"""Two data-parallel ranks (gloo): one file written by DP rank 0, the tracker by rank 0, RNG states per
DP rank under --data-parallel-random-init, and the newest tracker iteration wins across ranks."""

import os

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.training.checkpointing import saving
from megatron.training.checkpointing import load_checkpoint, read_metadata, save_checkpoint
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.checkpointing.tiny_run import (
    BATCH_SIZE,
    assert_same,
    build_run,
    make_args,
    model_state,
    rng_snapshot,
    seed_everything,
)


def _save_and_load(rank, directory, args):
    """Saves from both ranks with rank-specific generators, then loads into a fresh run (checking the
    weights); returns (files written by this rank, RNG at the save, RNG after the load)."""
    writes = []
    real_save = saving.save_atomically
    saving.save_atomically = lambda obj, filename: (writes.append(filename), real_save(obj, filename))
    try:
        args.save = args.load = directory
        model, optimizer, scheduler = build_run(args, seed=1234)  # the same weights on both DP ranks
        seed_everything(1000 + rank)
        saved_rng = rng_snapshot()
        save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
    finally:
        saving.save_atomically = real_save
    fresh_model, fresh_optimizer, fresh_scheduler = build_run(args, seed=77)
    seed_everything(5)
    load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=args)
    assert_same(model_state(fresh_model), model_state(model))
    return [os.path.relpath(name, directory) for name in writes], saved_rng, rng_snapshot()


def _data_parallel_checks(rank, world_size, directory, args):
    parallel_state.initialize_model_parallel()
    init_num_microbatches_calculator(rank, None, 2 * BATCH_SIZE, BATCH_SIZE, world_size)

    # A shared file system that lags: rank 1 still sees an older tracker.
    tracker = os.path.join(directory, f"tracker_{rank}.txt")
    with open(tracker, "w") as file:
        file.write(str(200 - 100 * rank))
    dist.barrier()
    newest = read_metadata(tracker)

    args.data_parallel_random_init = True
    per_rank = _save_and_load(rank, os.path.join(directory, "own_rngs"), args)
    args.data_parallel_random_init = False
    shared = _save_and_load(rank, os.path.join(directory, "shared_rng"), args)
    return newest, per_rank, shared


def test_two_data_parallel_ranks(tmp_path):
    args = make_args()
    results = run_distributed(_data_parallel_checks, 2, str(tmp_path), args)
    assert [newest for newest, _, _ in results] == [(200, False), (200, False)]
    for index, name in ((1, "own_rngs"), (2, "shared_rng")):
        writes = [result[index][0] for result in results]
        assert writes == [["iter_0000002/mp_rank_00/model_optim_rng.pt"], []], name
        assert (tmp_path / name / "latest_checkpointed_iteration.txt").read_text() == "2"
    saved = {index: [result[index][1] for result in results] for index in (1, 2)}
    loaded = {index: [result[index][2] for result in results] for index in (1, 2)}
    assert not (saved[1][0]["torch"] == saved[1][1]["torch"]).all()
    # --data-parallel-random-init: each DP rank gets its own generators back...
    assert_same(loaded[1], saved[1], "own RNG per DP rank")
    # ...otherwise the checkpoint holds DP rank 0's, and every rank takes them.
    assert_same(loaded[2], [saved[2][0], saved[2][0]], "RNG of DP rank 0")
