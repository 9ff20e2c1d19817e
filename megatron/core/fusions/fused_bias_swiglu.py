"""Bias + SwiGLU in one kernel: [gate, up] = x + b (halves of the last dimension), y = silu(gate) * up.

The fc1 output [..., 2f] holds the gate half then the up half (see megatron/core/transformer/mlp.py);
y is [..., f].
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions.cuda_fuser import cuda_fuser


def bias_swiglu_reference(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unfused function: [..., 2f] (+ [2f]) -> [..., f]."""
    if bias is not None:
        input = input + bias
    gate, up = torch.chunk(input, 2, dim=-1)
    return F.silu(gate) * up


@cuda_fuser
def _bias_swiglu_fused(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return bias_swiglu_reference(input, bias)


def bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Megatron's name: silu(gate) * up of `input + bias`, fused on CUDA."""
    return _bias_swiglu_fused(input, bias)
