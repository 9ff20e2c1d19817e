"""`save_checkpoint`: one torch-format file per model-parallel rank, then the tracker
(`--ckpt-format torch_dist` goes to dist_saving.py).

    1. every rank reads its RNG state (gathered over DP with --data-parallel-random-init)
    2. one data-parallel replica of each file name writes iter_N/mp_rank_../model_optim_rng.pt (layout.py)
       (--use-distributed-optimizer: and distrib_optim.pt, gathered from the DP ranks, distrib_optim.py)
    3. barrier: all files are complete
    4. global rank 0 writes latest_checkpointed_iteration.txt
    5. barrier: nobody goes on before the checkpoint is "latest"

Each file is written under a temporary name and renamed (files.py), so a crash at any point leaves the
previous checkpoint as "latest" and never a half-written file under a final name.
"""

import os
from datetime import datetime

import torch.distributed as dist

from megatron.training.checkpointing.distrib_optim import finish_param_gathers, save_distributed_optimizer_state
from megatron.training.checkpointing.files import save_atomically
from megatron.training.checkpointing.latest import name_latest
from megatron.training.checkpointing.layout import (
    ensure_directory_exists,
    get_checkpoint_name,
    model_parallel_position,
    require_supported_format,
    writes_checkpoint_file,
)
from megatron.training.checkpointing.rng import get_rng_state
from megatron.training.checkpointing.save_failures import explain_save_failure
from megatron.training.checkpointing.state_dict import generate_state_dict
from megatron.training.console import print_rank_0
from megatron.training.global_vars import get_args


def _timestamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    iteration,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far,
    checkpointing_context=None,
    pipeline_rank=None,
    expert_rank=None,
    tensor_rank=None,
    pipeline_parallel=None,
    expert_parallel=None,
    non_persistent_ckpt=False,
    train_data_iterator=None,
    release=False,
    args=None,
):
    """Saves model, optimizer, scheduler, RNG state and counters under `args.save` (collective: every rank
    calls it). Reading the state changes nothing: training continues exactly as without the save.

    `model` is a module or a list of model chunks. The rank/parallel overrides name the file for tools
    that write the checkpoint of another rank (checkpoint conversion); by default they come from
    `parallel_state`. `checkpointing_context` and `train_data_iterator` are accepted for Megatron's
    signature: a torch-format save keeps no context, and the built-in data loader resumes from
    `args.consumed_train_samples`. The framework passes `args`; without it (Megatron-LM's signature, a
    compatibility entry point) they are the run's `get_args()`.
    """
    args = args if args is not None else get_args()
    require_supported_format(args.ckpt_format)
    if args.save is None:
        raise ValueError("save_checkpoint needs --save, the directory to write checkpoints to")
    if non_persistent_ckpt:
        raise ValueError("non-persistent checkpoints (--non-persistent-save-interval) are not supported yet")
    print_rank_0(
        f"[{_timestamp()}] saving checkpoint at iteration {iteration:7d} to {args.save} in {args.ckpt_format} format"
    )

    if args.use_distributed_optimizer:
        finish_param_gathers(model)
    rng_state = None if args.no_save_rng else get_rng_state(args.data_parallel_random_init)
    if args.ckpt_format == "torch_dist":  # dist_saving.py loads torch.distributed.checkpoint: imported when used
        from megatron.training.checkpointing.dist_saving import save_sharded_checkpoint

        save_sharded_checkpoint(args, iteration, model, optimizer, opt_param_scheduler, rng_state,
                                num_floating_point_operations_so_far, args.save, release=release)
        return
    checkpoint_name = get_checkpoint_name(
        args.save, iteration, release=release, pipeline_parallel=pipeline_parallel, tensor_rank=tensor_rank,
        pipeline_rank=pipeline_rank, expert_parallel=expert_parallel, expert_rank=expert_rank,
    )
    # Model-parallel replicas over DP (and CP, which holds the same weights) are identical: one writes.
    # With EP > 1 the experts differ between DP ranks: one rank of each (tp, pp, ep) writes.
    if writes_checkpoint_file():
        state_dict = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=iteration)
        state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
        ensure_directory_exists(checkpoint_name)
        # Disk full, quota, I/O error, Ctrl-C: nothing was renamed into place and the tracker was not touched.
        with explain_save_failure(args.save, iteration, os.path.dirname(os.path.dirname(checkpoint_name))):
            save_atomically(state_dict, checkpoint_name)
    if args.use_distributed_optimizer and optimizer is not None and not args.no_save_optim:
        save_distributed_optimizer_state(optimizer, checkpoint_name)

    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        name_latest(args.save, iteration, release, args.save_retain_interval)
        print_rank_0(
            f"  [{_timestamp()}] successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
            f"{model_parallel_position()}"
        )
    _barrier()
