"""Forward/backward schedules over microbatches (Megatron-Core's `pipeline_parallel/schedules.py`).

A schedule runs `forward_step_func` on `num_microbatches` microbatches, backpropagates each loss, and
returns the loss reports of the last pipeline stage. `get_forward_backward_func()` picks it:

    PP = 1                        forward_backward_no_pipelining                      (below)
    PP > 1                        forward_backward_pipelining_without_interleaving   (one_f_one_b.py)
    PP > 1 with virtual stages    forward_backward_pipelining_with_interleaving      (interleaved.py)

The per-microbatch pieces (loss scaling, backward, freeing sent outputs) are in microbatch_step.py and are
importable from here under Megatron-Core's names.
"""

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.grad_sync import GradSyncSwitch, finalize_gradients, new_token_count
from megatron.core.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving
from megatron.core.pipeline_parallel.microbatch_step import (
    backward_step,
    custom_backward,
    deallocate_output_tensor,
    forward_step,
    get_model_config,
    timed_schedule,
)
from megatron.core.pipeline_parallel.one_f_one_b import forward_backward_pipelining_without_interleaving

__all__ = [
    "backward_step",
    "custom_backward",
    "deallocate_output_tensor",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_step",
    "get_forward_backward_func",
    "get_model_config",
]


def get_forward_backward_func():
    """The schedule for the current parallel layout (see the module docstring)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


@timed_schedule
def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
):
    """All microbatches on one stage: gradients accumulate under `no_sync` for all but the last one,
    whose backward lets the data-parallel reduction happen; then `finalize_model_grads`."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("the no-pipelining schedule takes one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if collect_non_loss_data:
        raise ValueError("collect_non_loss_data is not supported yet")
    config = get_model_config(model)
    forward_data_store = []
    total_num_tokens = new_token_count()
    grad_sync = GradSyncSwitch(config)
    grad_sync.disable()
    with torch.set_grad_enabled(not forward_only):
        for microbatch in range(num_microbatches):
            if microbatch == num_microbatches - 1:
                grad_sync.enable()
            loss, num_tokens = forward_step(
                forward_step_func, data_iterator, model, num_microbatches, None, forward_data_store, config
            )
            total_num_tokens.add_(num_tokens)
            if not forward_only:
                backward_step(None, loss, None, config)
    grad_sync.enable()
    if not forward_only:
        finalize_gradients(config, [model], total_num_tokens)
    return forward_data_store
