"""Transformer building blocks of Megatron-Core: config, layer specs, attention, MLP, layer, block."""

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

__all__ = ["MLATransformerConfig", "MegatronModule", "ModuleSpec", "TransformerConfig", "build_module"]
