"""Megatron-LM's command line: `parse_args` then `validate_args`, with Megatron's flags, dests and defaults.

    args = parse_args(extra_args_provider, args_list=["--num-layers", "12", ...])
    args = validate_args(args, defaults={"tokenizer_type": "GPT2BPETokenizer"})

The flags live in one module per group (model.py, training.py, data.py, ...); deprecated.py translates
removed Megatron flags, unsupported.py refuses features not built yet, validation.py derives Megatron's
values and reports every problem at once; config_file.py reads `--config-file`; core_configs.py converts
the result into `TransformerConfig`, `OptimizerConfig` and `DistributedDataParallelConfig`.
"""

from megatron.training.arguments.core_configs import (
    core_transformer_config_from_args,
    ddp_config_from_args,
    optimizer_config_from_args,
)
from megatron.training.arguments.parser import add_megatron_arguments, build_parser, parse_args
from megatron.training.arguments.validation import validate_args

__all__ = [
    "add_megatron_arguments",
    "build_parser",
    "core_transformer_config_from_args",
    "ddp_config_from_args",
    "optimizer_config_from_args",
    "parse_args",
    "validate_args",
]
