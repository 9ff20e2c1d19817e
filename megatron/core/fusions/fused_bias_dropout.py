"""Bias + dropout + residual add in one kernel: out = residual + dropout(x + b, p).

Used for both residual joins of a transformer layer. On CUDA the compiled kernel draws its dropout mask
from the current CUDA generator (inside the tensor-parallel RNG region when the layer asks for one), so
the masks differ from eager PyTorch's while the distribution is the same - as with Megatron's fused
kernel.
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions.cuda_fuser import cuda_fuser


@cuda_fuser
def _bias_dropout_add_fused(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float, training: bool
) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    if training and prob > 0:
        x = F.dropout(x, p=prob, training=True)
    return residual + x


def bias_dropout_add_fused(x_with_bias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    """`x_with_bias` is a sub-layer's `(output [s, b, h], bias [h] or None)`; residual [s, b, h]."""
    x, bias = x_with_bias
    return _bias_dropout_add_fused(x, bias, residual, prob, training)
