"""Imports of the tokenizer back ends that are optional extras (sentencepiece, tiktoken, transformers)."""

import importlib


def import_optional(module: str, needed_by: str, pip_name: str = ""):
    """Imports `module`, or raises an ImportError saying which tokenizer needs it and what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{needed_by} needs the `{module}` package, which is not installed: pip install {pip_name or module}"
        ) from error
