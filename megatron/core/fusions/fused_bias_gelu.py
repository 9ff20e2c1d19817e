"""Bias + GeLU (tanh approximation) in one kernel: y = gelu_tanh(x + b).

Megatron's fused bias-GeLU computes the tanh approximation
0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), z = x + b, so that is the function here too.
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions.cuda_fuser import cuda_fuser


def bias_gelu_reference(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unfused function: [..., f] (+ [f]) -> [..., f]."""
    if bias is not None:
        input = input + bias
    return F.gelu(input, approximate="tanh")


@cuda_fuser
def _bias_gelu_fused(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return bias_gelu_reference(input, bias)


def bias_gelu_impl(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Megatron's name: gelu_tanh(input + bias), one fused kernel forward and one backward on CUDA."""
    return _bias_gelu_fused(input, bias)
