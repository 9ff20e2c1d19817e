"""Bookkeeping of the MoE auxiliary losses: their gradient, and their values for logging.

Gradient. The load-balancing and z losses are not added to the language-model loss that the schedule
differentiates; `MoEAuxLossAutoScaler` attaches each one to an activation of the router instead: the
forward returns the activation unchanged, the backward also returns d(aux_loss)/d(aux_loss) = `scale`
for the loss, so autograd adds scale * d(aux_loss)/d(params). The scale must equal the one the schedule
applies to the main loss (loss scale / num_microbatches), set once per step with `set_loss_scale`
(Megatron sets it in the schedule's forward step; the training loop here does it before the step).

Logging (Megatron's names `load_balancing_loss`, `seq_load_balancing_loss`, `z_loss`). Each MoE layer
adds its loss, divided by its coefficient, to a per-layer slot of a tracker;
`reduce_aux_losses_tracker_across_ranks` sums the slots over pipeline stages and over the ranks that
hold parts of one loss (tensor/context parallel), averages over data-parallel replicas, and
`aux_losses_for_logging` returns the mean over MoE layers of each loss, then clears the tracker.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """`output = MoEAuxLossAutoScaler.apply(activation, aux_loss)`: identity on `activation`, and the
    backward sends gradient `main_loss_backward_scale` into `aux_loss`."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.tensor(1.0)
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """The factor the schedule applies to the main loss: grad scale / num_microbatches."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().float().reshape(())


def set_aux_loss_scale(config, num_microbatches: int) -> None:
    """Before a training step: the aux losses' gradient scale, the main loss's (the loss scale, divided by
    the microbatch count unless the loss is normalised per token). The multi-token-prediction losses use it
    too. No-op for a dense model without them."""
    if config.num_moe_experts is None and not config.mtp_num_layers:
        return
    one = torch.ones(1, device=parallel_state.collective_device())
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    MoEAuxLossAutoScaler.set_loss_scale(scale if config.calculate_per_token_loss else scale / num_microbatches)


_TRACKER: dict = {}


def moe_aux_loss_names(load_balancing_type: str, aux_loss_coeff: float, z_loss_coeff: float | None) -> list:
    """The tracked losses of a MoE setting, in a fixed order (every rank must reduce the same list)."""
    names = []
    if aux_loss_coeff and load_balancing_type == "aux_loss":
        names.append("load_balancing_loss")
    if aux_loss_coeff and load_balancing_type == "seq_aux_loss":
        names.append("seq_load_balancing_loss")
    if z_loss_coeff:
        names.append("z_loss")
    return names


def get_moe_layer_wise_logging_tracker() -> dict:
    """{loss name: [num_layers] fp32 tensor of per-layer sums over this step's microbatches}."""
    return _TRACKER


def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: int, num_layers: int) -> None:
    """Adds `loss` (detached) to slot `layer_number - 1` (layer numbers are global and 1-based)."""
    if name not in _TRACKER or _TRACKER[name].numel() != num_layers:
        _TRACKER[name] = torch.zeros(num_layers, device=loss.device)
    _TRACKER[name][layer_number - 1] += loss.detach().float()


def clear_aux_losses_tracker() -> None:
    """Zeros every slot (called after each step's values were read)."""
    for values in _TRACKER.values():
        values.zero_()


def reduce_aux_losses_tracker_across_ranks(names: list, num_layers: int, device: torch.device) -> None:
    """For each of `names`: sum over pipeline stages (each holds its layers' slots) and over tensor x
    context ranks (each routed its own part of the tokens and holds that part of the loss), then the
    mean over data-parallel replicas."""
    for name in names:
        if name not in _TRACKER:
            _TRACKER[name] = torch.zeros(num_layers, device=device)
        values = _TRACKER[name]
        if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
            continue
        dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(values, group=parallel_state.get_tensor_and_context_parallel_group())
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
        values /= parallel_state.get_data_parallel_world_size()


def aux_losses_for_logging(names: list, num_layers: int, num_moe_layers: int, loss_scale: float) -> dict:
    """{name: mean over the MoE layers of the loss * loss_scale}, reduced over ranks; clears the tracker.

    Collective: every rank calls it after the step, with `names` from `moe_aux_loss_names`. `loss_scale`
    is 1 / num_microbatches, since each microbatch added its loss to the slots.
    """
    reduce_aux_losses_tracker_across_ranks(names, num_layers, parallel_state.collective_device())
    losses = {name: _TRACKER[name].sum() * loss_scale / max(num_moe_layers, 1) for name in names}
    clear_aux_losses_tracker()
    return losses
