"""residual + dropout(x + bias): how each sub-layer's output joins the residual stream."""

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused


def bias_dropout_add(x_with_bias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    """`x_with_bias` is a sub-layer's `(output, bias or None)` pair; all tensors are [s, b, h]."""
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def get_bias_dropout_add(training: bool, fused: bool):
    """Megatron's spec slot: returns `f(x_with_bias, residual, prob)`. `fused` (`--bias-dropout-fusion`,
    on by default) picks the one-kernel version of megatron/core/fusions on CUDA."""
    function = bias_dropout_add_fused if fused else bias_dropout_add

    def bias_dropout_add_for_mode(x_with_bias, residual, prob):
        return function(x_with_bias, residual, prob, training)

    return bias_dropout_add_for_mode
