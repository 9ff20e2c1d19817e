"""The training layer: arguments, `pretrain()`, checkpoints, tokenizers, logging.

Kept import-light on purpose: `tools/preprocess_data.py` imports `megatron.training.tokenizer`, which must
work without torch (Megatron-LM's own chain from there imports Transformer Engine: NVIDIA/Megatron-LM#1476).
The names Megatron-LM exports here (`get_args`, `pretrain`, `print_rank_0`, ...) are resolved on first use.
"""

_LAZY = {
    "get_args": "megatron.training.global_vars",
    "get_tokenizer": "megatron.training.global_vars",
    "get_timers": "megatron.training.global_vars",
    "get_tensorboard_writer": "megatron.training.global_vars",
    "get_wandb_writer": "megatron.training.global_vars",
    "print_rank_0": "megatron.training.console",
    "print_rank_last": "megatron.training.console",
    "is_last_rank": "megatron.training.console",
    "initialize_megatron": "megatron.training.initialize",
    "pretrain": "megatron.training.training",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
