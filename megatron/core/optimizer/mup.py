"""muP's optimizer side (megatron/core/transformer/mup.py has the model side): per parameter class, the learning
rate and Adam's epsilon scaled by the width multiplier m = hidden_size / mup_base_hidden_size, as Megatron-Core's
`get_mup_config_overrides`.

    class          which params                                        Adam(W)           SGD
    vector-like    the embeddings and the output layer (tagged          lr, eps           lr * m
                   `is_embedding_parameter` or `shared_embedding`;
                   untagged ones whose name contains "embedding"),
                   and every param of
                   one dimension or none (biases, norm weights)
    hidden         every other param (the weight matrices)              lr / m, eps / m   lr

`lr` is both ends of the schedule: a scaled group gets `max_lr` and `min_lr` times the factor. Muon keeps its
own scaling for the matrices it updates (no override; with other optimizers than Adam(W) and SGD the hidden
params get lr / m and no epsilon). With a decoupled LR the embedding and output params keep it, unscaled.
With m = 1 nothing changes.
"""

import logging
from typing import Callable, Optional

import torch

from .optimizer_config import OptimizerConfig

logger = logging.getLogger(__name__)


def _is_vector_like(param: torch.nn.Parameter, name: str) -> bool:
    if getattr(param, "shared_embedding", False):
        return True
    if getattr(param, "is_embedding_parameter", None) is not None:
        return bool(param.is_embedding_parameter) or param.dim() <= 1
    return "embedding" in name.lower() or param.dim() <= 1


def mup_group_overrides(config: OptimizerConfig, width_mult: float, is_muon_param: Callable) -> Optional[Callable]:
    """`overrides(name, param)` -> the {"max_lr", "min_lr", "eps"} values muP gives the param's group (empty
    for params it leaves alone), or None when nothing changes (m = 1). `is_muon_param(param)`: the matrices
    Muon updates under --optimizer muon (excluded)."""
    is_sgd, is_adam = config.optimizer == "sgd", "adam" in config.optimizer
    if config.decoupled_lr is not None:
        logger.warning("muP with --decoupled-lr: the embedding and output params keep the decoupled LR, unscaled")
    if config.optimizer == "muon" and config.muon_scale_mode == "spectral":
        logger.warning("muP with --muon-scale-mode spectral: the matrices Muon updates keep the spectral scaling "
                       "(--muon-scale-mode unit_rms_norm gives them the unit-RMS scaling muP expects)")
    if width_mult == 1.0:
        return None
    min_lr = 0.0 if config.min_lr is None else config.min_lr

    def scaled_lr(factor: float) -> dict:
        return {"max_lr": config.lr * factor, "min_lr": min_lr * factor}

    def overrides(name: str, param: torch.nn.Parameter) -> dict:
        decoupled = config.decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
        vector_like = _is_vector_like(param, name)
        if is_sgd:
            return scaled_lr(width_mult) if vector_like and not decoupled else {}
        if vector_like or (config.optimizer == "muon" and is_muon_param(param)):
            return {}
        values = {} if decoupled else scaled_lr(1.0 / width_mult)
        if is_adam:
            values["eps"] = config.adam_eps / width_mult
        return values

    return overrides
