"""Process-wide objects of a training run, with Megatron-LM's accessor names.

Only the training layer (and entry scripts written against Megatron-LM) use these; `megatron.core` is
configured by dataclasses and never reads them (megatron/core never imports megatron/training).
"""

_ARGS = None
_TOKENIZER = None
_TENSORBOARD_WRITER = None
_WANDB_WRITER = None
_TIMERS = None


def _ensure(value, name: str):
    if value is None:
        raise RuntimeError(f"{name} is not initialised: call initialize_megatron() (or pretrain()) first")
    return value


def get_args():
    """The parsed and validated argparse Namespace of this run."""
    return _ensure(_ARGS, "args")


def set_args(args) -> None:
    global _ARGS
    _ARGS = args


def get_tokenizer():
    return _ensure(_TOKENIZER, "tokenizer")


def set_tokenizer(tokenizer) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


def get_tensorboard_writer():
    """The TensorBoard SummaryWriter, on the last rank only; None elsewhere or when disabled."""
    return _TENSORBOARD_WRITER


def set_tensorboard_writer(writer) -> None:
    global _TENSORBOARD_WRITER
    _TENSORBOARD_WRITER = writer


def get_wandb_writer():
    """The W&B run, on the last rank only; None elsewhere or when disabled."""
    return _WANDB_WRITER


def set_wandb_writer(writer) -> None:
    global _WANDB_WRITER
    _WANDB_WRITER = writer


def get_timers():
    return _ensure(_TIMERS, "timers")


def set_timers(timers) -> None:
    global _TIMERS
    _TIMERS = timers


def unset_global_variables() -> None:
    """Forgets every global (tests run several trainings in one process)."""
    global _ARGS, _TOKENIZER, _TENSORBOARD_WRITER, _WANDB_WRITER, _TIMERS
    _ARGS = _TOKENIZER = _TENSORBOARD_WRITER = _WANDB_WRITER = _TIMERS = None
