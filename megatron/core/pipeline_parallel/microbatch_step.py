"""One microbatch forward and one backward on one model chunk - the pieces every schedule is made of.

Loss scaling on the last stage, as Megatron does it:

    3-tuple loss_func -> (loss_sum, num_tokens, report):
        backward on loss_sum / num_tokens / num_microbatches   (per-microbatch token mean, averaged)
        or on loss_sum itself with calculate_per_token_loss    (finalize_model_grads then divides all
                                                                gradients by the global token count)
    legacy 2-tuple loss_func -> (loss, report):
        backward on loss * CP / num_microbatches               (the loss is a mean over this rank's
                                                                1/CP of the tokens; DDP divides by DP x CP)
"""

import contextlib
import functools

import torch
from torch.autograd.variable import Variable

from megatron.core import parallel_state
from megatron.core.timers import timed


def get_model_config(model):
    """The `TransformerConfig` of a model, through any DDP / Float16Module wrappers."""
    module = model
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "config"):
        raise ValueError(f"{type(model).__name__} has no `config`: schedules need a Megatron-Core model")
    return module.config


def _set_input_tensor(model, input_tensor) -> None:
    """Hands the activation received from the previous stage to the model (under any wrappers)."""
    module = model
    while not hasattr(module, "set_input_tensor") and hasattr(module, "module"):
        module = module.module
    if hasattr(module, "set_input_tensor"):
        module.set_input_tensor(input_tensor)
    elif input_tensor is not None:
        raise ValueError(
            f"{type(model).__name__} has no set_input_tensor: a model on a pipeline stage after the first must "
            "take its input from the previous stage"
        )


def _device_type(model) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


def _scaled_loss(outputs, config, num_microbatches: int):
    """(the tensor to backpropagate, its token count, the report) from loss_func's outputs."""
    if len(outputs) == 3:
        loss, num_tokens, report = outputs
        if not config.calculate_per_token_loss:
            loss = loss / num_tokens.clamp(min=1) if torch.is_tensor(num_tokens) else loss / max(num_tokens, 1)
            loss = loss / num_microbatches
        return loss, num_tokens, report
    if len(outputs) == 2:
        loss, report = outputs
        loss = loss * parallel_state.get_context_parallel_world_size() / num_microbatches
        return loss, torch.tensor(0, dtype=torch.int), report
    raise ValueError(
        f"loss_func returned {len(outputs)} values; expected (loss_sum, num_tokens, report) or (loss, report)"
    )


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    input_tensor,
    forward_data_store: list,
    config,
    is_last_stage: bool = True,
):
    """Runs one microbatch forward on `model` (one chunk), fed `input_tensor` (None on the first stage).

    Returns (output, token count): on the last stage the scaled loss to backpropagate and its loss
    tokens (the report goes to `forward_data_store`); elsewhere the activation [s, b, h] for the next
    stage and a zero count.
    """
    _set_input_tensor(model, input_tensor)
    autocast = (
        torch.autocast(device_type=_device_type(model), dtype=config.autocast_dtype or config.params_dtype)
        if config.enable_autocast
        else contextlib.nullcontext()
    )
    with timed(config.timers, "forward-compute", log_level=2):
        with autocast:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        if not is_last_stage:
            return output_tensor, torch.tensor(0, dtype=torch.int)
        loss, num_tokens, report = _scaled_loss(loss_func(output_tensor), config, num_microbatches)
    forward_data_store.append(report)
    return loss, num_tokens


def deallocate_output_tensor(output_tensor, deallocate_pipeline_outputs: bool) -> None:
    """Frees the data of a stage output that has been sent to the next stage.

    After the send only its `grad_fn` is needed (backward starts there with the gradient that comes
    back), but its [s, b, h] data would stay alive until that backward, once per microbatch in flight.
    Replacing `.data` by a one-element tensor releases it; `custom_backward` then runs the autograd
    engine without the shape check that would now fail. A view is left alone: its memory belongs to
    its base, which lives on anyway.
    """
    if output_tensor is None or not deallocate_pipeline_outputs or output_tensor._base is not None:
        return
    output_tensor.data = torch.empty((1,), device=output_tensor.device, dtype=output_tensor.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backpropagates `grad_output` from `output` through the C++ autograd engine directly.

    `torch.autograd.backward` checks that `grad_output` has `output`'s shape, which a deallocated output
    ([1]) no longer has; the engine itself only needs the graph.
    """
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Backpropagates one microbatch of one chunk; returns the gradient of its input (None on the first
    stage). On the last stage `output_tensor` is the loss and `output_tensor_grad` None; the loss scale
    (fp16) is applied there only, the other stages receive already-scaled gradients."""
    with timed(config.timers, "backward-compute", log_level=2):
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_tensor_grad is None and config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        if config.deallocate_pipeline_outputs:
            custom_backward(output_tensor, output_tensor_grad)
        else:
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


def timed_schedule(schedule):
    """Times a whole schedule call as `forward-backward` (timer level 1), as Megatron's schedules do."""

    @functools.wraps(schedule)
    def run(**kwargs):
        model = kwargs["model"]
        config = get_model_config(model[0] if isinstance(model, list) else model)
        with timed(config.timers, "forward-backward", log_level=1,
                   barrier=getattr(config, "barrier_with_L1_time", False)):
            return schedule(**kwargs)

    return run
