"""`build_tokenizer(args)`: the tokenizer named by `--tokenizer-type`, after checking its flags and files."""

import math
import os

from megatron.core.tokenizers.bert_wordpiece import BertWordPieceTokenizer
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizers.tiktoken_tokenizer import PATTERNS, TikTokenizer

# --tokenizer-type -> the attributes holding the files it reads. HuggingFaceTokenizer's
# --tokenizer-model is a directory or a hub id, which the tokenizer itself checks.
FILES_BY_TYPE = {
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": (),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": (),
}
TOKENIZER_TYPES = tuple(FILES_BY_TYPE)
# The types whose vocabulary size --vocab-size sets (the others read theirs from their files).
SIZED_BY_VOCAB_SIZE = ("NullTokenizer", "TikTokenizer")


def vocab_size_with_padding(
    orig_vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Rows of the embedding and output layers: `ceil(V / m) * m` with `m = divisible_by * TP`.

    Each tensor-parallel rank holds `padded / TP` rows, a multiple of `divisible_by` (GPU-friendly
    shapes). GPT-2's 50257 -> 50304 at TP 1, 50432 at TP 2, 51200 at TP 8.
    """
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and the tensor-parallel size "
            f"({tensor_model_parallel_size}) must be >= 1"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


def _flag(attribute: str) -> str:
    return "--" + attribute.replace("_", "-")


def tokenizer_problems(args) -> list[str]:
    """Everything wrong with the tokenizer flags, to report at once."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type is None:
        return [f"--tokenizer-type is required; choose one of {', '.join(TOKENIZER_TYPES)}"]
    if tokenizer_type not in FILES_BY_TYPE:
        return [f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"]
    problems = []
    for attribute in FILES_BY_TYPE[tokenizer_type]:
        path = getattr(args, attribute, None)
        if path is None:
            problems.append(f"{_flag(attribute)} is required by --tokenizer-type {tokenizer_type}")
        elif not os.path.isfile(path):
            what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
            problems.append(f"{_flag(attribute)} {path!r} (needed by --tokenizer-type {tokenizer_type}) {what}")
    if tokenizer_type == "HuggingFaceTokenizer" and getattr(args, "tokenizer_model", None) is None:
        problems.append("--tokenizer-model (a directory or a hub id) is required by --tokenizer-type HuggingFaceTokenizer")
    if getattr(args, "special_tokens", None) and tokenizer_type not in ("HuggingFaceTokenizer", "TikTokenizer"):
        problems.append(f"--tokenizer-special-tokens is not supported yet with --tokenizer-type {tokenizer_type} "
                        "(it is with HuggingFaceTokenizer and TikTokenizer)")
    if getattr(args, "fim_data", False) and tokenizer_type not in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
        problems.append(f"--fim-data is not supported yet with --tokenizer-type {tokenizer_type} (it is with "
                        "GPT2BPETokenizer and HuggingFaceTokenizer)")
    vocab_size = getattr(args, "vocab_size", None)
    if tokenizer_type == "NullTokenizer" and vocab_size is None:
        problems.append("--vocab-size is required by --tokenizer-type NullTokenizer")
    if vocab_size is not None and tokenizer_type not in SIZED_BY_VOCAB_SIZE:
        # Megatron-LM reads --vocab-size only for these types and ignores it for the others without a word,
        # which hides a wrong tokenizer: the embedding has the rows of the tokenizer's own vocabulary.
        problems.append(
            f"--vocab-size {vocab_size} is only used by --tokenizer-type {' and '.join(SIZED_BY_VOCAB_SIZE)}; "
            f"--tokenizer-type {tokenizer_type} takes its vocabulary size from its files: leave --vocab-size out "
            "(the embedding is padded to a multiple of --make-vocab-size-divisible-by, or give --padded-vocab-size)"
        )
    if tokenizer_type == "TikTokenizer" and getattr(args, "tiktoken_pattern", None) not in PATTERNS:
        problems.append(
            f"--tiktoken-pattern v1 or v2 is required by --tokenizer-type TikTokenizer, "
            f"got {getattr(args, 'tiktoken_pattern', None)!r}"
        )
    return problems


def _construct(args) -> MegatronTokenizer:
    tokenizer_type = args.tokenizer_type
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(
            args.vocab_file,
            lower_case=tokenizer_type == "BertWordPieceLowerCase",
            vocab_extra_ids=getattr(args, "vocab_extra_ids", 0),
        )
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(args.tokenizer_model, vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(args.tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(args.tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(
            args.tokenizer_model,
            trust_remote_code=getattr(args, "trust_remote_code", False),
            include_special_tokens=not getattr(args, "tokenizer_hf_no_include_special_tokens", False),
            additional_special_tokens=getattr(args, "special_tokens", None),
        )
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            args.tokenizer_model,
            pattern=args.tiktoken_pattern,
            vocab_size=getattr(args, "vocab_size", None),
            num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
            special_tokens=getattr(args, "special_tokens", None),
        )
    return NullTokenizer(
        args.vocab_size,
        eod_id=getattr(args, "null_tokenizer_eod_id", None),
        pad_id=getattr(args, "null_tokenizer_pad_id", -1),
    )


def construct_tokenizer(args) -> MegatronTokenizer:
    """The tokenizer of `args` (an argparse Namespace or any object with the tokenizer flags), after checking
    its flags and files; prints Megatron's "> building ... tokenizer" line on rank 0 (`args.rank`, default 0).
    Changes nothing in `args`."""
    problems = tokenizer_problems(args)
    if problems:
        raise ValueError("invalid tokenizer arguments:\n  - " + "\n  - ".join(problems))
    if getattr(args, "rank", 0) == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    return _construct(args)


def padded_vocab_size(args, tokenizer: MegatronTokenizer) -> int:
    """The model's vocabulary rows: `args.padded_vocab_size` when set (from `--padded-vocab-size` or a
    checkpoint), else the tokenizer's size padded with `args.make_vocab_size_divisible_by` (default 128) and
    `args.tensor_model_parallel_size` (default 1), with Megatron's log line on rank 0."""
    padded = getattr(args, "padded_vocab_size", None)
    if padded is None:
        padded = vocab_size_with_padding(
            tokenizer.vocab_size,
            getattr(args, "make_vocab_size_divisible_by", 128),
            getattr(args, "tensor_model_parallel_size", 1),
        )
        if getattr(args, "rank", 0) == 0:
            print(
                f" > padded vocab (size: {tokenizer.vocab_size}) with {padded - tokenizer.vocab_size} dummy "
                f"tokens (new size: {padded})",
                flush=True,
            )
    elif padded < tokenizer.vocab_size:
        raise ValueError(
            f"--padded-vocab-size {padded} is smaller than the {args.tokenizer_type} vocabulary "
            f"({tokenizer.vocab_size} ids)"
        )
    return padded


def build_tokenizer(args) -> MegatronTokenizer:
    """Megatron-LM's `build_tokenizer`: `construct_tokenizer`, and `args.padded_vocab_size` set to
    `padded_vocab_size(args, tokenizer)` (where Megatron's model providers read it)."""
    tokenizer = construct_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(args, tokenizer)
    return tokenizer
