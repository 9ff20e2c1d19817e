"""One training iteration: the forward and backward passes of every microbatch, then the optimizer step.

    zero the gradient buffers -> schedule of the parallel layout (no pipelining, 1F1B or interleaved) over the
    step's microbatches -> loss reports reduced to global token means -> optimizer step (gradient norm,
    clipping, the bad-step veto, the update) -> scheduler step by the samples trained

With --rerun-mode validate_results the re-run engine (megatron/core/rerun_state_machine.py) may have the
forward and backward passes run again on the same data before the update, or stop the run (RerunExit)
before it.

`run_train_step` takes everything explicitly (the Trainer calls it); `train_step` is Megatron-LM's name and
signature for code outside the Trainer (a compatibility entry point), taking the arguments (`get_args()`), the
layout and the current batch from the process-wide state.
"""

from functools import partial

import torch
import torch.distributed as dist

from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_current_running_global_batch_size,
    get_num_microbatches,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale
from megatron.training.batch_plan import StepBatch
from megatron.training.global_vars import get_args
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.pipeline_loss import broadcast_from_last_stage
from megatron.training.profiling import empty_unused_memory
from megatron.training.run_callbacks import bind_args


class RerunExit(Exception):
    """The re-run engine stops the run before the iteration's update: `exit_code` (Megatron-LM's 16 or 17),
    and whether a checkpoint of the state before the iteration is to be saved first."""

    def __init__(self, exit_code: int, save_checkpoint: bool):
        super().__init__(f"the re-run engine stops the run with exit code {exit_code}")
        self.exit_code, self.save_checkpoint = exit_code, save_checkpoint


def run_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, args,
                   batch: StepBatch, layout: ParallelLayout, bad_step_guard=None, forward_backward_func=None):
    """One optimizer step over `batch.num_microbatches` microbatches. Returns (loss dict, skipped, grad norm,
    num zeros); the loss values are exact global token means Σloss / Σtokens over DP x CP. Losses and the
    grad norm may be device tensors: reading them waits for the GPU, which the loop does only to log.

    `bad_step_guard` (bad_step.py) may veto the update (skipped, grad norm NaN when something was
    non-finite) or raise BadStepStop. `forward_backward_func` defaults to the schedule of the parallel
    layout (the loop passes it wrapped in a full-iteration CUDA graph with --cuda-graph-impl full_iteration).
    Raises RerunExit when the re-run engine stops the run (the update is not applied)."""
    rerun_engine = get_rerun_state_machine()
    while rerun_engine.should_run_forward_backward(data_iterator):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        set_aux_loss_scale(config, batch.num_microbatches)
        losses = (forward_backward_func or get_forward_backward_func())(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=batch.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
            forward_only=False,
        )
    save_checkpoint, stop, exit_code = rerun_engine.should_checkpoint_and_exit()
    if stop:
        raise RerunExit(exit_code, save_checkpoint)
    empty_unused_memory(args, level=1)
    loss_dict = reduce_loss_reports(losses, layout)
    increment = batch.running_global_batch_size
    veto = None
    if bad_step_guard is not None and bad_step_guard.enabled:
        veto = partial(bad_step_guard.check, losses, loss_dict, scheduler_increment=increment)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step_with_device_grad_norm(veto=veto)
    empty_unused_memory(args, level=2)
    if not update_successful:
        # A bad step vetoed at once comes back with its norm, an fp16 overflow without one.
        return loss_dict, 1, (bad_step_guard.skipped_grad_norm if grad_norm is not None else None), None
    opt_param_scheduler.step(increment=increment)
    # A verdict left on the device (bad_step.py) is this step's "skipped" flag, counted without reading it.
    device_veto = bad_step_guard.device_veto if bad_step_guard is not None else None
    return loss_dict, (device_veto if device_veto is not None else 0), grad_norm, num_zeros_in_grad


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func=None):
    """Megatron-LM's `train_step`, a compatibility entry point (module docstring); returns what
    `run_train_step` returns."""
    args = get_args()
    batch = StepBatch(get_current_global_batch_size(), get_current_running_global_batch_size(),
                      get_num_microbatches())
    return run_train_step(bind_args(forward_step_func, args), data_iterator, model, optimizer, opt_param_scheduler,
                          config, args, batch, ParallelLayout.from_parallel_state(),
                          forward_backward_func=forward_backward_func)


def reduce_loss_reports(reports: list, layout: ParallelLayout) -> dict:
    """Combines the per-microbatch loss reports of the last stage.

    2-element reports `[loss_sum, num_tokens]` are summed over microbatches and DP x CP ranks, giving the
    exact global token mean; 1-element (legacy, already DP-averaged) values are averaged over microbatches.
    With pipeline parallelism the result is broadcast from the last stage to the others.
    """
    reduced = {}
    if reports and layout.is_last_stage:
        for key in reports[0]:
            values = [torch.as_tensor(report[key]).detach().float().view(-1) for report in reports]
            if values[0].numel() == 2:
                total = torch.stack(values).sum(dim=0)
                dist.all_reduce(total, group=layout.data_context_parallel_group)
                reduced[key] = total[0] / total[1].clamp(min=1)
            else:
                reduced[key] = torch.cat(values).mean()
    return broadcast_from_last_stage(reduced)


def learning_rates(optimizer) -> tuple:
    """(learning rate, decoupled learning rate or None) of the optimizer's parameter groups."""
    learning_rate = decoupled = None
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr", False):
            decoupled = group["lr"]
        else:
            learning_rate = group["lr"]
    return learning_rate, decoupled
