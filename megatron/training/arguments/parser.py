"""Megatron's command line: one parser made of the flag groups, `--config-file`, and `parse_args`."""

import argparse
import difflib
import os
import sys

from megatron.preprocessing.tokenizer_arguments import add_tokenizer_args
from megatron.training.arguments.checkpointing import _add_checkpointing_args
from megatron.training.arguments.config_file import add_config_file_arg, find_config_file, read_config_file
from megatron.training.arguments.data import _add_data_args
from megatron.training.arguments.deprecated import _add_deprecated_args
from megatron.training.arguments.logging import _add_logging_args
from megatron.training.arguments.mla_mtp import _add_mla_mtp_args
from megatron.training.arguments.model import _add_fusion_args, _add_initialization_args, _add_network_size_args
from megatron.training.arguments.moe import _add_moe_args
from megatron.training.arguments.optimizer import (
    _add_learning_rate_args,
    _add_optimizer_args,
    _add_regularization_args,
)
from megatron.training.arguments.parallel import _add_distributed_args
from megatron.training.arguments.precision import _add_low_precision_args, _add_mixed_precision_args
from megatron.training.arguments.resilience import _add_resilience_args
from megatron.training.arguments.training import _add_autoresume_args, _add_training_args, _add_validation_args


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse that answers an unrecognized flag with the closest known one."""

    def error(self, message: str):
        prefix = "unrecognized arguments:"
        if message.startswith(prefix):
            known = [option for action in self._actions for option in action.option_strings]
            hints = []
            for token in message[len(prefix):].split():
                flag = token.split("=")[0]
                close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
                if close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
            if hints:
                message = f"{message} ({'; '.join(hints)})"
        super().error(message)


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every Megatron flag group to `parser`."""
    for add_group in (
        _add_network_size_args,
        _add_fusion_args,
        _add_regularization_args,
        _add_training_args,
        _add_initialization_args,
        _add_optimizer_args,
        _add_learning_rate_args,
        _add_checkpointing_args,
        _add_mixed_precision_args,
        _add_low_precision_args,
        _add_distributed_args,
        _add_validation_args,
        _add_data_args,
        _add_autoresume_args,
        _add_moe_args,
        _add_mla_mtp_args,
        _add_logging_args,
        _add_resilience_args,
        _add_deprecated_args,
    ):
        parser = add_group(parser)
    add_tokenizer_args(parser, vocab_padding=False)
    add_config_file_arg(parser)
    return parser


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The full parser; `extra_args_provider(parser) -> parser` adds a script's own flags (returning None
    is accepted too)."""
    parser = MegatronArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def _env_int(name: str, default: int) -> int:
    raw = os.getenv(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args_list=None) -> argparse.Namespace:
    """Parses `args_list` (default `sys.argv[1:]`) on top of `--config-file`, if one is given.

    The result is not validated: call `validate_args(args, defaults)` next, as Megatron does. `rank` and
    `world_size` come from the RANK / WORLD_SIZE variables that torchrun sets (0 and 1 otherwise).
    """
    parser = build_parser(extra_args_provider)
    argv = sys.argv[1:] if args_list is None else list(args_list)
    config_path = find_config_file(argv)
    # Values from the file pre-populate the namespace; argparse then only overwrites the flags given on
    # the command line and fills the remaining defaults.
    namespace = argparse.Namespace(**(read_config_file(config_path, parser) if config_path else {}))
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv, namespace)
    else:
        args = parser.parse_args(argv, namespace)
    args.rank = _env_int("RANK", 0)
    args.world_size = _env_int("WORLD_SIZE", 1)
    return args
