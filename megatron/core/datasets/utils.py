"""Megatron-LM's import path `megatron.core.datasets.utils` for `Split`, `normalize` and
`get_blend_from_list`, which live in `split.py` and `blend.py` here; scripts written for Megatron-LM
import them from this module."""

from megatron.core.datasets.blend import get_blend_from_list, normalize
from megatron.core.datasets.split import Split

__all__ = ["Split", "get_blend_from_list", "normalize"]
