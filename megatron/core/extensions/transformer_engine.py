"""The only module that imports NVIDIA Transformer Engine (TE). TE is optional: nothing else in the
framework needs it, and asking for it without it installed is an ImportError that says what to do."""

import importlib

INSTALL_HINT = (
    'install it with `pip install "megatron[te]"` (transformer-engine[pytorch], needs CUDA), or use the '
    "pure-PyTorch layers: get_gpt_layer_local_spec() / --transformer-impl local (the same model)"
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
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        return False
    return True
