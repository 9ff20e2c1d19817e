"""The only module that imports NVIDIA Transformer Engine (TE). TE is optional: nothing else in the
framework needs it, and asking for it without it installed is an ImportError that says what to do.

This framework has no TE layer spec yet: `--transformer-impl transformer_engine` (Megatron-LM's default) runs
the same model on this framework's own PyTorch layers, with or without TE installed, and says so in one line;
Megatron-Core's `get_*_with_transformer_engine_*spec()` functions build the local layers too (they need TE
installed, as Megatron-Core's do)."""

import importlib

from megatron.core.extensions import import_optional

INSTALL_COMMAND = '`pip install "megatron[te]"` (transformer-engine[pytorch], needs CUDA)'
INSTALL_HINT = (
    f"install it with {INSTALL_COMMAND}, or use the pure-PyTorch layers: get_gpt_layer_local_spec() / "
    "--transformer-impl local (the same model)"
)


def require_transformer_engine(feature: str):
    """Returns the `transformer_engine` module, or raises ImportError naming `feature` and the fix."""
    try:
        return importlib.import_module("transformer_engine")
    except ImportError as error:
        raise ImportError(
            f"{feature} needs NVIDIA Transformer Engine, which is not installed: {INSTALL_HINT}"
        ) from error


def is_transformer_engine_available() -> bool:
    """True when `transformer_engine` imports."""
    return import_optional("transformer_engine", instead="the layers are pure PyTorch") is not None


TRANSFORMER_IMPL_NOTE = (
    "the model runs on this framework's own PyTorch layers (the same model as Transformer Engine's layers; "
    "checkpoints keep the local layer names, e.g. input_layernorm.weight)"
)


def transformer_impl_note() -> str:
    """What `--transformer-impl transformer_engine` does here, for an installation with or without TE."""
    if is_transformer_engine_available():
        return f"{TRANSFORMER_IMPL_NOTE}; Transformer Engine is installed, but no layer spec here uses it yet"
    return f"{TRANSFORMER_IMPL_NOTE}; Transformer Engine is not installed"


def describe() -> str:
    """One line for the banner and `doctor`."""
    if is_transformer_engine_available():
        return "installed, not used (its layer spec is not built here yet; the layers are pure PyTorch)"
    return "not installed (not needed: the layers are pure PyTorch)"
