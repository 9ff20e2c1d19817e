"""Inference contexts: the state a model forward pass carries between generation steps (the KV cache)."""

from megatron.core.inference.contexts.static_context import StaticInferenceContext

__all__ = ["StaticInferenceContext"]
