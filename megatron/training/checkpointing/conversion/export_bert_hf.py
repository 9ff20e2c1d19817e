"""`tools/checkpoint/export_bert_hf.py`: a pretrain_bert.py checkpoint -> a Hugging Face model directory.

    python tools/checkpoint/export_bert_hf.py --load checkpoints/bert --save-dir bert-hf

writes `model.safetensors`, `config.json`, `vocab.txt` and `tokenizer_config.json`, which
`transformers.AutoModelForPreTraining.from_pretrained(dir)` / `BertTokenizer.from_pretrained(dir)` load.
The model shape and the tokenizer come from the arguments stored in the checkpoint; tensor- and
pipeline-parallel size must be 1 (one file holds the whole model). The weight maps are in `bert_hf.py`;
reading and writing the directories is the conversion package's (torch_checkpoint.py, hf_directory.py).
"""

import argparse
import os

import torch

from megatron.core.atomic_write import write_atomically
from megatron.training.checkpointing.conversion.bert_hf import bert_export_shape, bert_to_hf, hf_config
from megatron.training.checkpointing.conversion.hf_directory import write_hf_directory
from megatron.training.checkpointing.conversion.torch_checkpoint import read_torch_checkpoint
from megatron.core.tokenizers import build_tokenizer

WORDPIECE_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")


def read_bert_checkpoint(load_dir: str, ckpt_step: int | None) -> tuple[dict, argparse.Namespace]:
    """(full model state dict, training arguments) of the TP=1, PP=1 BERT checkpoint in `load_dir`."""
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"--load {load_dir}: no such directory")
    state, args, iteration, _ = read_torch_checkpoint(load_dir, ckpt_step)
    layout = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if layout != (1, 1):
        raise ValueError(f"{load_dir} (iteration {iteration}) was saved with tensor/pipeline-parallel sizes "
                         f"{layout}: the BERT export reads TP=1, PP=1 checkpoints only for now")
    if "lm_head.dense.weight" not in state:
        raise ValueError(f"{load_dir} (iteration {iteration}) is not a BERT checkpoint (it has no "
                         "lm_head.dense.weight): export_bert_hf.py exports pretrain_bert.py checkpoints")
    return state, args


def vocab_lines(tokenizer) -> list[str]:
    """The tokenizer's tokens in id order: vocab.txt, then the [BOS], [EOS] and sentinels Megatron adds."""
    inverse = tokenizer.inv_vocab
    if sorted(inverse) != list(range(tokenizer.vocab_size)):
        raise ValueError("the vocabulary's ids are not 0 .. V-1 (does the vocab file repeat a line?): a "
                         "vocab.txt cannot express it")
    return [inverse[token_id] for token_id in range(tokenizer.vocab_size)]


def export_bert(load_dir: str, save_dir: str, ckpt_step: int | None = None, vocab_file: str | None = None) -> dict:
    """Writes the Hugging Face model directory; returns its config.json as a dict."""
    state, args = read_bert_checkpoint(load_dir, ckpt_step)
    if vocab_file is not None:
        args.vocab_file = vocab_file
    if args.tokenizer_type not in WORDPIECE_TYPES:
        raise ValueError(f"{load_dir} was trained with --tokenizer-type {args.tokenizer_type}; the export writes a "
                         f"WordPiece vocab.txt, so it needs {' or '.join(WORDPIECE_TYPES)}")
    args.rank = 1  # no tokenizer log lines
    tokenizer = build_tokenizer(args)
    shape = bert_export_shape(args, tokenizer.vocab_size)
    hf_state = bert_to_hf(state, shape)
    token_types = hf_state["bert.embeddings.token_type_embeddings.weight"]
    config = hf_config(shape, token_types.shape[0], token_types.dtype, tokenizer.pad)

    os.makedirs(save_dir, exist_ok=True)
    vocab = "".join(token + "\n" for token in vocab_lines(tokenizer)).encode("utf-8")
    write_atomically(os.path.join(save_dir, "vocab.txt"), lambda stream: stream.write(vocab))
    tokenizer_config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": args.tokenizer_type == "BertWordPieceLowerCase",
        "model_max_length": args.max_position_embeddings,
    }
    write_hf_directory(save_dir, hf_state, config, tokenizer_config=tokenizer_config)
    print(f" exported {load_dir} as {shape.architecture} to {save_dir}", flush=True)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a pretrain_bert.py checkpoint to Hugging Face BERT.")
    parser.add_argument("--load", required=True, help="the --save directory of the training run")
    parser.add_argument("--save-dir", required=True, help="where the Hugging Face files go")
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default: the latest)")
    parser.add_argument("--vocab-file", default=None, help="the WordPiece vocab.txt, if it moved since training")
    options = parser.parse_args(argv)
    with torch.no_grad():
        export_bert(options.load, options.save_dir, options.ckpt_step, options.vocab_file)
    return 0
