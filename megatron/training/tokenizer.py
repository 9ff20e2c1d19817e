"""Megatron-LM's module path before its tokenizers moved to `megatron.core.tokenizers` (Feb 2026).

Entry scripts written against Megatron-LM <= v0.16 import `from megatron.training.tokenizer import
build_tokenizer`, the one name that package exported; the tokenizers themselves are in
`megatron.core.tokenizers`.
"""

from megatron.core.tokenizers import build_tokenizer

__all__ = ["build_tokenizer"]
