"""Forward/backward schedules over microbatches (Megatron-Core's `pipeline_parallel/schedules.py`).

A schedule runs `forward_step_func` on `num_microbatches` microbatches, backpropagates each loss, and
returns the loss reports of the last pipeline stage. Loss scaling, as Megatron does it:

    3-tuple loss_func -> (loss_sum, num_tokens, report):
        backward on loss_sum / num_tokens / num_microbatches   (per-microbatch token mean, averaged)
        or on loss_sum itself with calculate_per_token_loss    (finalize_model_grads then divides all
                                                                gradients by the global token count)
    legacy 2-tuple loss_func -> (loss, report):
        backward on loss / num_microbatches

Only the no-pipelining schedule exists so far; pipeline parallelism comes with the pipeline issue.
"""

import contextlib

import torch

from megatron.core import parallel_state


def get_model_config(model):
    """The `TransformerConfig` of a model, through any DDP / Float16Module wrappers."""
    module = model
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "config"):
        raise ValueError(f"{type(model).__name__} has no `config`: schedules need a Megatron-Core model")
    return module.config


def get_forward_backward_func():
    """The schedule for the current parallel layout (no pipelining when PP = 1)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("pipeline parallelism (pipeline-model-parallel-size > 1) is not supported yet")
    return forward_backward_no_pipelining


def forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_data_store):
    """Runs one microbatch forward; returns (the tensor to backpropagate, its token count)."""
    autocast = (
        torch.autocast(device_type=_device_type(model), dtype=config.autocast_dtype or config.params_dtype)
        if config.enable_autocast
        else contextlib.nullcontext()
    )
    with autocast:
        output_tensor, loss_func = forward_step_func(data_iterator, model)
    outputs = loss_func(output_tensor)
    if len(outputs) == 3:
        loss, num_tokens, report = outputs
        if not config.calculate_per_token_loss:
            loss = loss / num_tokens.clamp(min=1) if torch.is_tensor(num_tokens) else loss / max(num_tokens, 1)
            loss = loss / num_microbatches
    elif len(outputs) == 2:
        loss, report = outputs
        num_tokens = torch.tensor(0, dtype=torch.int)
        loss = loss / num_microbatches
    else:
        raise ValueError(
            f"loss_func returned {len(outputs)} values; expected (loss_sum, num_tokens, report) or (loss, report)"
        )
    forward_data_store.append(report)
    return loss, num_tokens


def backward_step(loss, config) -> None:
    if config.grad_scale_func is not None:
        loss = config.grad_scale_func(loss)
    loss.backward()


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
    no_sync = config.no_sync_func or contextlib.nullcontext
    forward_data_store = []
    token_counts = []  # kept on the device: summing them on the host would sync every microbatch

    def one_microbatch():
        if forward_only:
            with torch.no_grad():
                forward_step(forward_step_func, data_iterator, model, num_microbatches, config, forward_data_store)
            return
        loss, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, config, forward_data_store
        )
        token_counts.append(torch.as_tensor(num_tokens).detach())
        backward_step(loss, config)

    with no_sync():
        for _ in range(num_microbatches - 1):
            one_microbatch()
    one_microbatch()

    if not forward_only and config.finalize_model_grads_func is not None:
        total_num_tokens = torch.stack(token_counts).sum() if config.calculate_per_token_loss else None
        config.finalize_model_grads_func([model], total_num_tokens)
    return forward_data_store


def _device_type(model) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"
