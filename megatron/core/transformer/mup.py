"""Maximal Update Parametrization (muP; Yang et al., "Tensor Programs V", 2022) as Megatron-Core applies it.

A model of width h is trained as a proxy of width h0 = `mup_base_hidden_size` scaled by m = h / h0, so that
the hyperparameters tuned on the proxy (learning rate, init std) transfer to the wide model. With `use_mup`:

    init        hidden weights N(0, sigma^2 / m); the output projections (linear_proj, linear_fc2)
                N(0, sigma^2 / (2L m)); the embeddings, and an untied output layer, N(0, sigma_e^2) with
                sigma_e = `embedding_init_method_std` (default sigma): the proxy's, unscaled
    attention   softmax(QK^T * s) with s = sqrt(mup_base_head_dim or 1) / d_head^mup_attn_scale_power:
                1/d_head by default instead of 1/sqrt(d_head) (an explicit `softmax_scale` wins)
    embedding   its output times `mup_embedding_mult`
    logits      times `mup_output_mult`, which defaults to 1/m
    optimizer   per-parameter-class learning rate and Adam epsilon (megatron/core/optimizer/mup.py)

Without `mup_base_hidden_size` the run is its own proxy: m = 1, and only the attention scale changes.
"""

import math
import warnings

import torch

from megatron.core.transformer.config_rules import SettingName, field_setting


def mup_problems(settings, name: SettingName = field_setting) -> list[str]:
    """The muP settings of `settings` (a TransformerConfig or the arguments) that cannot work."""
    if not getattr(settings, "use_mup", False):
        return []
    problems = []
    base = settings.mup_base_hidden_size
    if base is not None and base <= 0:
        problems.append(f"{name('mup_base_hidden_size', base)} must be positive")
    if settings.mup_base_head_dim is not None and settings.mup_base_head_dim <= 0:
        problems.append(f"{name('mup_base_head_dim', settings.mup_base_head_dim)} must be positive")
    return problems


def apply_mup(config) -> None:
    """Fills the derived muP fields of a TransformerConfig whose sizes are known (`__post_init__`): the width
    multiplier, the attention scale and the logits multiplier (module docstring)."""
    if config.mup_base_hidden_size is None:
        config.mup_base_hidden_size = config.hidden_size
    config.mup_width_mult = config.hidden_size / config.mup_base_hidden_size
    if config.softmax_scale is None:
        base_scale = 1.0 if config.mup_base_head_dim is None else math.sqrt(config.mup_base_head_dim)
        config.softmax_scale = base_scale / config.kv_channels ** config.mup_attn_scale_power
    if config.mup_output_mult == 1.0 and config.mup_width_mult != 1.0:
        config.mup_output_mult = 1.0 / config.mup_width_mult
    custom = [field for field in ("init_method", "output_layer_init_method") if getattr(config, field) is not None]
    if custom:
        warnings.warn(f"use_mup with a custom {' and '.join(custom)}: muP's width scaling of the init does not "
                      "apply to it", UserWarning, stacklevel=4)


def scale_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """The output layer's logits times `mup_output_mult` under muP, else unchanged."""
    if config.use_mup and config.mup_output_mult != 1.0:
        return logits * config.mup_output_mult
    return logits


def output_layer_init_method(config, share_embeddings_and_output_weights: bool):
    """An untied output layer starts like the embeddings under muP (it is an "embedding-class" parameter), else
    like the hidden weights."""
    if config.use_mup and not share_embeddings_and_output_weights:
        return config.embedding_init_method
    return config.init_method


def mark_embedding_parameters(module: torch.nn.Module) -> None:
    """Tags every parameter of `module` `is_embedding_parameter`: the muP optimizer keeps their base learning
    rate and epsilon (megatron/core/optimizer/mup.py)."""
    for param in module.parameters():
        param.is_embedding_parameter = True
