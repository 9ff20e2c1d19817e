"""The training layer: arguments, `pretrain()`, checkpoints, logging.

The names Megatron-LM exports here (`get_args`, `pretrain`, `print_rank_0`, ...) are resolved on first use:
importing any module of this package runs this file first, and the checkpoint converter
(`tools/checkpoint/convert.py`) reads arguments and checkpoints without loading the training loop, the model
code or a GPU library.
"""

from megatron.core.lazy_names import lazy_names

__getattr__ = lazy_names(__name__, {
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
})
