"""`load_checkpoint`: resume (or start a fine-tune) from a checkpoint (reference 8.2); the tensors of a
`--ckpt-format torch_dist` checkpoint are read by dist_loading.py, under any parallel layout.

What is restored:

    resume                        model, optimizer, scheduler, RNG, iteration, consumed-sample counters
    --no-load-optim / --no-load-rng  the same without optimizer+scheduler / RNG
    release checkpoint            model only, iteration 0; counters restored
    --finetune (or --pretrained-checkpoint when --load has none)
                                  model only, iteration 0, counters left at 0
"""

import os

import torch.distributed as dist

from megatron.core.num_microbatches_calculator import update_num_microbatches
from megatron.training.batch_plan import BatchPlan
from megatron.training.checkpointing.checkpoint_args import check_checkpoint_args
from megatron.training.checkpointing.distrib_optim import load_distributed_optimizer_state
from megatron.training.checkpointing.layout import checkpoint_exists, model_parallel_position, require_supported_format
from megatron.training.checkpointing.reading import load_base_checkpoint
from megatron.training.checkpointing.rng import set_rng_state
from megatron.training.checkpointing.state_dict import load_model_state
from megatron.training.console import print_rank_0
from megatron.training.global_vars import get_args
from megatron.training.rerun_engine import note_pending_rerun
from megatron.training.run_summary import record_loaded_checkpoint
from megatron.training.train_state import TrainState, checkpoint_iteration

# Checkpoints before 2.0 stored the fused QKV rows as [3, np, hn] (version 0) or [np, hn, 3] (1.0) instead of
# Megatron-Core's per-head interleaving.
_OLDEST_SUPPORTED_VERSION = 2.0


def _resume_directory(args, load_arg: str):
    """`args.<load_arg>`, or --pretrained-checkpoint when that holds no checkpoint (then a fine-tune)."""
    load_dir = getattr(args, load_arg)
    pretrained_dir = getattr(args, "pretrained_checkpoint", None)
    if pretrained_dir is None or checkpoint_exists(load_dir):
        return load_dir
    print_rank_0(
        f"Checkpoint file not found in load directory {load_dir} attempting to finetune with checkpoint in "
        f"{pretrained_dir}"
    )
    if not checkpoint_exists(pretrained_dir):
        raise FileNotFoundError(
            f"no checkpoint in the load directory ({load_dir}) nor in --pretrained-checkpoint {pretrained_dir}: "
            "neither holds latest_checkpointed_iteration.txt"
        )
    args.finetune = True
    return pretrained_dir


def _load_optimizer_and_scheduler(optimizer, opt_param_scheduler, state_dict: dict, checkpoint_name: str) -> None:
    scheduler_key = "lr_scheduler" if "lr_scheduler" in state_dict else "opt_param_scheduler"  # older name first
    missing = [name for name, wanted in (("optimizer", optimizer), (scheduler_key, opt_param_scheduler))
               if wanted is not None and name not in state_dict]
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint_name} has no {' or '.join(missing)} state (was it saved with --no-save-optim?); "
            "pass --no-load-optim or --finetune to start the optimizer afresh"
        )
    if optimizer is not None:
        optimizer.load_state_dict(state_dict["optimizer"])
    if opt_param_scheduler is not None:
        # The scheduler applies --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler itself.
        opt_param_scheduler.load_state_dict(state_dict[scheduler_key])


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, checkpointing_context=None,
                    args=None):
    """Megatron-LM's `load_checkpoint`: `load_train_state`, with the restored counters written into `args`
    (`args.consumed_train_samples`, ...) and the microbatch calculator moved to them, as Megatron does;
    returns (iteration, num_floating_point_operations_so_far), (0, 0) when there was nothing to load.

    `checkpointing_context` is accepted for Megatron's signature (a torch-format load keeps none). The
    framework calls `load_train_state` with its arguments; `args` here defaults to the run's `get_args()`
    (Megatron-LM's signature, a compatibility entry point).
    """
    args = args if args is not None else get_args()
    state = load_train_state(model, optimizer, opt_param_scheduler, args, load_arg, strict)
    if state is None:
        return 0, 0
    if not args.finetune:
        state.publish(args)
        update_num_microbatches(state.consumed_train_samples, consistency_check=False, verbose=True)
    return state.iteration, state.num_floating_point_operations_so_far


def load_train_state(model, optimizer, opt_param_scheduler, args, load_arg="load", strict=True) -> TrainState | None:
    """Loads the checkpoint under `args.<load_arg>` into `model` (a module or list of chunks), `optimizer`
    and `opt_param_scheduler`; returns the run's counters at that checkpoint (module docstring), or None when
    there is no checkpoint (a note; raises with --exit-on-missing-checkpoint). Collective: every rank calls it.
    """
    require_supported_format(args.ckpt_format)
    load_dir = _resume_directory(args, load_arg)
    state_dict, checkpoint_name, release = load_base_checkpoint(load_dir, args)
    if state_dict is None:
        return None

    checkpoint_version = state_dict.get("checkpoint_version", 0)
    if checkpoint_version < _OLDEST_SUPPORTED_VERSION:
        raise ValueError(
            f"checkpoint {checkpoint_name} has checkpoint_version {checkpoint_version}: the QKV layout of "
            f"versions below {_OLDEST_SUPPORTED_VERSION} is not supported; re-save it with a Megatron-LM "
            "release that converts it"
        )
    iteration = 0 if args.finetune or release else checkpoint_iteration(state_dict, checkpoint_name)
    # Imported here: they load torch.distributed.checkpoint, which a run that loads nothing does not need.
    from megatron.core.dist_checkpointing import is_distributed_checkpoint
    from megatron.training.checkpointing.dist_loading import load_sharded_state

    sharded = is_distributed_checkpoint(checkpoint_name)
    if not args.finetune:
        if "args" in state_dict:
            check_checkpoint_args(state_dict["args"], args, checkpoint_version, checkpoint_name,
                                  check_parallel_sizes=not sharded)
        else:
            print_rank_0("could not find arguments in the checkpoint ...")
    state = TrainState.from_checkpoint(state_dict, iteration, BatchPlan.from_args(args),
                                       restore_counters=not args.finetune)
    note_pending_rerun(state_dict, iteration)

    load_optimizer = not (release or args.finetune or args.no_load_optim)
    load_rng = not (release or args.finetune or args.no_load_rng)
    if sharded:
        load_rng = load_sharded_state(model, optimizer, state_dict, checkpoint_name, args,
                                      load_optimizer and optimizer is not None, load_rng)
    else:
        load_model_state(model, state_dict, strict, checkpoint_name)
    print_rank_0(f" checkpoint version {checkpoint_version}")

    if load_optimizer:
        _load_optimizer_and_scheduler(None if sharded else optimizer, opt_param_scheduler, state_dict, checkpoint_name)
        if args.use_distributed_optimizer and optimizer is not None and not sharded:
            load_distributed_optimizer_state(optimizer, checkpoint_name)
        if optimizer is not None:
            optimizer.refresh_fp8_params()  # --fp8-param-gather: the weights from the exact main params
    elif optimizer is not None and (args.fp16 or args.bf16):
        # The fp32 main params still hold the initial weights: take them from the loaded model.
        optimizer.reload_model_params()

    if load_rng:
        set_rng_state(state_dict, args.data_parallel_random_init, checkpoint_name)

    if dist.is_initialized():
        dist.barrier()
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} {model_parallel_position()} at iteration {iteration}")
    directory = checkpoint_name if sharded else os.path.dirname(os.path.dirname(checkpoint_name))
    record_loaded_checkpoint(directory, iteration, state.consumed_train_samples,
                             weights_only=release or args.finetune)
    return state
