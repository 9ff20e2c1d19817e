"""The distributed optimizer's part of a torch-format checkpoint (reference 8.1), as Megatron-LM writes it:

    iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt   "optimizer": param groups (with Adam's step) and grad scaler
    iter_N/mp_rank_TT[_PPP]/distrib_optim.pt     main params and Adam moments of all data-parallel ranks,
                                                 gathered on DP rank 0 (megatron/core/optimizer/
                                                 distrib_optimizer_state.py has the layout)

Saving and loading are collective over the data-parallel group: every rank sends (or receives) its
shard, DP rank 0 alone touches the file, which is written crash-safe (files.py) before the tracker
names the iteration.
"""

import os

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.training.checkpoint.files import load_checkpoint_file, save_atomically
from megatron.training.checkpoint.layout import ensure_directory_exists

DISTRIBUTED_OPTIMIZER_BASENAME = "distrib_optim.pt"


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name) -> str:
    """`distrib_optim.pt` beside this rank's `model_optim_rng.pt`."""
    return os.path.join(os.path.dirname(model_checkpoint_name), DISTRIBUTED_OPTIMIZER_BASENAME)


def _data_parallel_rank() -> int:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) if dist.is_initialized() else 0


def finish_param_gathers(model) -> None:
    """Makes every param whole before it is saved: with --overlap-param-gather the all-gathers after the
    last optimizer step would otherwise wait for the next forward."""
    for chunk in model if isinstance(model, list) else [model]:
        if isinstance(chunk, DistributedDataParallel):
            chunk.start_param_sync(force_sync=True)


def save_distributed_optimizer_state(optimizer, model_checkpoint_name) -> None:
    """Gathers the sharded optimizer state on DP rank 0, which writes `distrib_optim.pt` (collective)."""
    state = optimizer.get_parameter_state_dp_zero()
    if _data_parallel_rank() == 0:
        filename = get_distributed_optimizer_checkpoint_name(model_checkpoint_name)
        ensure_directory_exists(filename)
        save_atomically(state, filename)


def load_distributed_optimizer_state(optimizer, model_checkpoint_name) -> None:
    """Reads `distrib_optim.pt` on DP rank 0 and scatters it into every rank's shards (collective).

    Call after `optimizer.load_state_dict`, which allocates the Adam state this fills.
    """
    filename = get_distributed_optimizer_checkpoint_name(model_checkpoint_name)
    state, problem = None, None
    if _data_parallel_rank() == 0:
        if not os.path.isfile(filename):
            problem = (
                f"{filename} does not exist: the distributed optimizer (--use-distributed-optimizer) keeps its "
                "state there. Was the checkpoint saved without it? Then resume without it, or pass --no-load-optim"
            )
        else:
            try:
                state = load_checkpoint_file(filename)
            except ValueError as error:
                problem = str(error)
    if dist.is_initialized():
        # Only DP rank 0 reads the file; the others must fail with it instead of waiting in the scatter.
        group = parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=dist.get_global_rank(group, 0), group=group)
        problem = verdict[0]
    if problem is not None:
        raise ValueError(problem)
    try:
        optimizer.load_parameter_state_from_dp_zero(state)
    except ValueError as error:
        raise ValueError(f"{filename}: {error}") from error
