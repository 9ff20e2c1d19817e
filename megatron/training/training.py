"""`pretrain()`: Megatron-LM's entry point (its megatron/training/training.py), with its classic signature.

    pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, ...)

parse and validate the command line -> checks before the model (preflight.py; `--dry-run` stops there) ->
`initialize_megatron` (process groups, seeds, tokenizer, timers, writers) -> a `Trainer` (trainer.py) builds
model, optimizer, scheduler (and resumes), builds the data iterators, trains, saves, validates and tests ->
the process groups are freed -> the run's summary line.

Also here, under Megatron-LM's names and signatures, for code that drives the pieces itself: `get_model`,
`setup_model_and_optimizer`, `get_optimizer_param_scheduler` and `train_step`. Having no parameter for the
arguments, they read the run's `get_args()` (compatibility entry points; the framework itself passes the
arguments explicitly, to the Trainer).
"""

import gc
import sys
import time

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training.batch_plan import BatchPlan
from megatron.training.dry_run import dry_run
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer
from megatron.training.initialize import initialize_megatron, parse_and_validate_args
from megatron.training.model_chunks import get_model
from megatron.training.preflight import preflight
from megatron.training.run_summary import print_run_summary
from megatron.training.step import train_step
from megatron.training.train_schedule import TrainingSchedule
from megatron.training.trainer import Trainer

__all__ = ["get_model", "get_optimizer_param_scheduler", "pretrain", "setup_model_and_optimizer", "train_step"]


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults: dict | None = None,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    parsed_args=None,
):
    """Trains a model from the command line's arguments (`parsed_args`: already validated ones instead);
    see the module docstring for the flow. Exits with the run's exit code when it stopped early."""
    start = time.time()
    args = parsed_args if parsed_args is not None else parse_and_validate_args(extra_args_provider, args_defaults)
    # Recorded as Megatron-LM records it; the parameter and memory estimates tell a T5 by it.
    args.model_type = model_type
    preflight(args)
    if args.dry_run:
        dry_run(args)
        return
    initialize_megatron(
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        parsed_args=args,
    )
    exit_code = _run(args, train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, start)
    _shut_down()
    print_run_summary(args, start)
    if exit_code is not None:
        sys.exit(exit_code)


def _run(args, datasets_provider, model_provider, model_type, forward_step_func, start: float) -> int | None:
    """The Trainer's run; the model and optimizer die with this frame, so _shut_down can free their groups."""
    return Trainer(args, forward_step_func, start_time=start).run(datasets_provider, model_provider, model_type)


def _shut_down() -> None:
    """The end of a run that every rank reached (a finished run or a collective exit decision): writers
    finished, every rank past its last collective, then the process groups destroyed and freed while the
    interpreter is still whole.

    destroy_process_group alone frees no gloo group that something still references, and a gloo worker thread
    releases a finished collective's tensors a moment after the caller's wait() returned. A release that
    falls into interpreter teardown needs the GIL there and aborts the rank ("terminate called without an
    active exception" in ~AsyncAllgatherWork, seen in CI on a loaded 2-core machine; pytorch/pytorch#190489).
    Freeing the last reference to a group instead joins its worker threads, so this drops ours: the model
    and optimizer (gone with _run's frame), parallel_state's groups, then a collection pass.
    tests/functional_tests/test_process_exit.py checks that no gloo worker thread is left."""
    # A checkpoint still being written in the background (--async-save) becomes "latest" here; none is pending
    # where the torch_dist writer was never loaded.
    dist_saving = sys.modules.get("megatron.training.checkpointing.dist_saving")
    if dist_saving is not None:
        dist_saving.finalize_async_save(blocking=True)
    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.finish()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    parallel_state.destroy_model_parallel()
    gc.collect()


def get_optimizer_param_scheduler(optimizer):
    """Megatron-LM's name (a compatibility entry point: the arguments are the run's `get_args()`): the LR/WD
    scheduler of the run set up by `initialize_megatron`, its lengths in samples (train_schedule.py); writes the
    derived `args.train_iters` etc. as Megatron-LM does."""
    args = get_args()
    schedule = TrainingSchedule.from_args(args, BatchPlan.from_args(args))
    schedule.publish(args)
    return schedule.build_scheduler(optimizer, args)


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None, lr_mult=1.0):
    """Megatron-LM's name (a compatibility entry point: the arguments are the run's `get_args()`): model
    chunks, optimizer and scheduler of the run set up by `initialize_megatron`, resumed from --load (or
    --pretrained-checkpoint), with `args.iteration`, the consumed-sample counters and the derived lengths
    written into those arguments as Megatron-LM does."""
    trainer = Trainer(get_args())
    trainer.build_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond, scale_lr_cond, lr_mult)
    return trainer.model, trainer.optimizer, trainer.opt_param_scheduler
