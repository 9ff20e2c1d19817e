"""Megatron-LM's command line: `parse_args` then `validate_args`, with Megatron's flags, dests and defaults.

    args = parse_args(extra_args_provider, args_list=["--num-layers", "12", ...])
    args = validate_args(args, defaults={"tokenizer_type": "GPT2BPETokenizer"})

Each flag is a documented field of a section dataclass (megatron/training/config/: network size, training,
data, checkpointing, ...), and parser.py makes one argparse group per section; deprecated.py translates
removed Megatron flags, unsupported.py refuses features not built yet, validation.py runs each section's
own checks, the derived values (derived.py) and the rules across sections (validate_*.py), and reports
every problem at once; config_file.py reads `--config-file`; core_configs.py converts the result into
`TransformerConfig`, `OptimizerConfig` and `DistributedDataParallelConfig`.
"""

from megatron.core.lazy_names import lazy_names
from megatron.training.arguments.parser import add_megatron_arguments, build_parser, parse_args

# validation.py and core_configs.py import megatron.core (the transformer, optimizer and context-parallel
# packages); they are loaded on first use, so that the checkpoint tools read arguments without model code.
__getattr__ = lazy_names(__name__, {
    "validate_args": ".validation",
    "core_transformer_config_from_args": ".core_configs",
    "ddp_config_from_args": ".core_configs",
    "optimizer_config_from_args": ".core_configs",
})


__all__ = [
    "add_megatron_arguments",
    "build_parser",
    "core_transformer_config_from_args",
    "ddp_config_from_args",
    "optimizer_config_from_args",
    "parse_args",
    "validate_args",
]
