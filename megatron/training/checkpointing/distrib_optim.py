"""The distributed optimizer's part of a torch-format checkpoint (reference 8.1), as Megatron-LM writes it:

    iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt   "optimizer": param groups (with Adam's step) and grad scaler
    iter_N/mp_rank_TT[_PPP]/distrib_optim.pt     main params and Adam moments of all data-parallel ranks,
                                                 gathered on DP rank 0 (megatron/core/optimizer/
                                                 distrib_optimizer_state.py has the layout)

Saving and loading are collective over the data-parallel group: every rank sends (or receives) its
shard, DP rank 0 alone touches the file, which is written crash-safe (files.py) before the tracker
names the iteration.

With expert parallelism the optimizer is a chained one (dense params sharded over DP x CP, routed
experts over expert-DP), and the file holds a list, one gathered state per sub-optimizer, as Megatron-LM
writes it: each rank that is rank 0 of some sub-optimizer's group writes the file of its own directory,
with None for the states gathered elsewhere, and reads it back for those sub-optimizers. No two such
ranks share a directory: in a pipeline stage's first block of ranks the dense rank 0s are the first TP
ranks, the expert-DP rank 0s the first ETP x EP ones, and as ETP divides TP (which torch-format
checkpoints need) no two of these have the same TP and EP ranks.
"""

import os

import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.training.checkpointing.files import load_checkpoint_file, save_atomically
from megatron.training.checkpointing.layout import ensure_directory_exists

DISTRIBUTED_OPTIMIZER_BASENAME = "distrib_optim.pt"


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name) -> str:
    """`distrib_optim.pt` beside this rank's `model_optim_rng.pt`."""
    return os.path.join(os.path.dirname(model_checkpoint_name), DISTRIBUTED_OPTIMIZER_BASENAME)


def _sub_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _is_group_root(optimizer) -> bool:
    """Rank 0 of the data-parallel group that `optimizer` (a distributed one) shards its state over."""
    group = getattr(optimizer, "data_parallel_group", None)
    return not dist.is_initialized() or (group is not None and dist.get_rank(group) == 0)


def _holds_state(state) -> bool:
    return any(part is not None for part in state) if isinstance(state, list) else state is not None


def finish_param_gathers(model) -> None:
    """Makes every param whole before it is saved: with --overlap-param-gather the all-gathers after the
    last optimizer step would otherwise wait for the next forward. Not where each rank's param shard is saved
    (`saves_whole_params` False: ZeRO-3 on DDP's buffers), up to date after every step: gathering the whole
    model there would take its full memory for nothing."""
    for chunk in model if isinstance(model, list) else [model]:
        if isinstance(chunk, DistributedDataParallel) and chunk.saves_whole_params:
            chunk.start_param_sync(force_sync=True)


def save_distributed_optimizer_state(optimizer, model_checkpoint_name) -> None:
    """Gathers the sharded optimizer state on the data-parallel rank 0s, which write `distrib_optim.pt`
    (collective)."""
    state = optimizer.get_parameter_state_dp_zero()
    if _holds_state(state):
        filename = get_distributed_optimizer_checkpoint_name(model_checkpoint_name)
        ensure_directory_exists(filename)
        save_atomically(state, filename)


def _read_state(filename):
    """(the file's state, None) or (None, what is wrong with it)."""
    if not os.path.isfile(filename):
        return None, (
            f"{filename} does not exist: the distributed optimizer (--use-distributed-optimizer) keeps its "
            "state there. Was the checkpoint saved without it? Then resume without it, or pass --no-load-optim"
        )
    try:
        return load_checkpoint_file(filename), None
    except ValueError as error:
        return None, str(error)


def load_distributed_optimizer_state(optimizer, model_checkpoint_name) -> None:
    """Reads `distrib_optim.pt` on the data-parallel rank 0s and scatters it into every rank's shards
    (collective).

    Call after `optimizer.load_state_dict`, which allocates the Adam state this fills.
    """
    filename = get_distributed_optimizer_checkpoint_name(model_checkpoint_name)
    state, problem = None, None
    if any(_is_group_root(part) for part in _sub_optimizers(optimizer)):
        state, problem = _read_state(filename)
    if dist.is_initialized():
        # Only the rank 0s read the file; every rank must fail with them instead of waiting in the scatter.
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((found for found in problems if found is not None), None)
    if problem is not None:
        raise ValueError(problem)
    try:
        optimizer.load_parameter_state_from_dp_zero(state)
    except ValueError as error:
        raise ValueError(f"{filename}: {error}") from error
