"""convert.py loader `hf`: a Hugging Face directory (GPT-2, Llama / Mistral / Qwen2 / Mixtral, Qwen3-MoE,
DeepSeek-V3) as Megatron messages.

The training arguments are built from config.json (gpt2_hf.py / llama_hf.py / qwen3_moe_hf.py /
deepseek_v3_hf.py hold the maps) over this project's defaults; the weights become a release checkpoint
(iteration 0), so `pretrain_gpt.py --load` starts a fine-tune from them with fresh optimizer state. The tokenizer is the directory itself
(--tokenizer-type HuggingFaceTokenizer) when it holds tokenizer files.
"""

import os

import torch

from megatron.training.checkpointing.conversion.deepseek_v3_hf import (
    args_from_deepseek_v3_config,
    deepseek_v3_to_megatron,
)
from megatron.training.checkpointing.conversion.gpt2_hf import args_from_gpt2_config, gpt2_to_megatron
from megatron.training.checkpointing.conversion.gpt_shape import gpt_shape_from_args
from megatron.training.checkpointing.conversion.hf_directory import read_hf_directory
from megatron.training.checkpointing.conversion.llama_hf import (
    IMPORTABLE_MODEL_TYPES,
    args_from_llama_config,
    llama_to_megatron,
)
from megatron.training.checkpointing.conversion.messages import metadata_from_args, state_to_messages
from megatron.training.checkpointing.conversion.qwen3_moe_hf import args_from_qwen3_moe_config, qwen3_moe_to_megatron
from megatron.training.checkpointing.conversion.tokenizer_info import TokenizerInfo

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# model_type -> (training arguments of config.json, state dict map)
_IMPORTS = {
    "gpt2": (args_from_gpt2_config, gpt2_to_megatron),
    **{model_type: (args_from_llama_config, llama_to_megatron) for model_type in IMPORTABLE_MODEL_TYPES},
    "qwen3_moe": (args_from_qwen3_moe_config, qwen3_moe_to_megatron),
    "deepseek_v3": (args_from_deepseek_v3_config, deepseek_v3_to_megatron),
}


def add_arguments(parser) -> None:
    parser.add_argument_group(title="hf loader (Hugging Face directories): reads --load-dir")


def training_args(config: dict, vocab_rows: int, load_dir: str):
    """The argparse Namespace a pretrain_gpt.py run of this model would have (TP=1, PP=1)."""
    from megatron.training.arguments import build_parser

    args = build_parser().parse_args([])
    model_type = config.get("model_type")
    if model_type not in _IMPORTS:
        raise ValueError(f"{load_dir}/config.json model_type {model_type!r}: the hf loader reads "
                         f"{', '.join(_IMPORTS)}")
    values = _IMPORTS[model_type][0](config)
    for name, value in values.items():
        setattr(args, name, value)
    args.seq_length = args.max_position_embeddings
    args.padded_vocab_size = vocab_rows
    args.params_dtype = getattr(torch, config.get("torch_dtype") or "float32")
    args.bf16, args.fp16 = args.params_dtype == torch.bfloat16, args.params_dtype == torch.float16
    if any(os.path.isfile(os.path.join(load_dir, name)) for name in _TOKENIZER_FILES):
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", os.path.abspath(load_dir)
    return args


def load_checkpoint(queue, args) -> None:
    if args.model_type != "GPT":
        raise ValueError(f"--model-type {args.model_type}: the hf loader reads GPT-style causal LMs only")
    hf_state, config = read_hf_directory(args.load_dir)
    vocab_size = config["vocab_size"]
    checkpoint_args = training_args(config, vocab_size, args.load_dir)
    shape = gpt_shape_from_args(checkpoint_args, vocab_size)
    state = _IMPORTS[config["model_type"]][1](hf_state, shape)
    metadata = metadata_from_args(checkpoint_args, shape, iteration=0, release=True)
    metadata.tokenizer = TokenizerInfo(vocab_size=vocab_size, bos_token_id=config.get("bos_token_id"),
                                       eos_token_id=config.get("eos_token_id"))
    queue.put(metadata)
    for message in state_to_messages(state, shape):
        queue.put(message)
    queue.put("done")
