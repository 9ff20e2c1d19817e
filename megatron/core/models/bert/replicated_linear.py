"""A `torch.nn.Linear` that every tensor-parallel rank holds whole (Megatron's `get_linear_layer`).

BERT's pooler, LM-head transform and binary head are small (h x h or h x 2), so they are replicated
instead of split; every TP rank computes the same output and the same gradients.
"""

import torch

from megatron.core.tensor_parallel.layers import parameter_device
from megatron.core.transformer.transformer_config import TransformerConfig


def replicated_linear(input_size: int, output_size: int, init_method, config: TransformerConfig) -> torch.nn.Linear:
    """y = x W^T + b with W [output_size, input_size] drawn by `init_method` and b = 0."""
    layer = torch.nn.Linear(input_size, output_size, dtype=config.params_dtype, device=parameter_device(config))
    if config.perform_initialization:
        with torch.no_grad():
            init_method(layer.weight)
            layer.bias.zero_()
    return layer
