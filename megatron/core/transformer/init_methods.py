"""Weight initialisers of Megatron-Core: zero-mean normals, the output projections scaled by depth."""

import functools
import math

import torch


def init_method_normal(sigma: float):
    """In-place initialiser drawing from N(0, sigma^2)."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """N(0, (sigma / sqrt(multiplier * num_layers))^2), for `linear_proj` and `linear_fc2`.

    Each layer adds two residual branches, so scaling their output weights by 1/sqrt(2L) keeps the
    variance of the residual stream independent of depth (GPT-2 paper, section 2.3).
    """
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma / math.sqrt(multiplier * num_layers))


def mup_scaled_init_method_normal(sigma: float, num_layers: int, width_mult: float, multiplier: float = 2.0):
    """N(0, (sigma / (sqrt(multiplier * num_layers) * sqrt(width_mult)))^2): the depth scaling above times muP's
    1/sqrt(m) width scaling (m = hidden_size / mup_base_hidden_size), for `linear_proj` and `linear_fc2`."""
    std = sigma / (math.sqrt(multiplier * num_layers) * math.sqrt(width_mult))
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)
