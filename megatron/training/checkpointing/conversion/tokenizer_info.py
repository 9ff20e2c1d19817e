"""What a conversion needs from the tokenizer a checkpoint was trained with: its true vocabulary size,
its special ids, and the files to copy next to an exported model."""

import argparse
import copy
import os
from dataclasses import dataclass, field


@dataclass
class TokenizerInfo:
    """vocab_size None when the tokenizer cannot be built here (its files moved) and no size was given."""

    vocab_size: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    files: dict = field(default_factory=dict)  # {source path: file name in a Hugging Face directory}
    tokenizer_class: str | None = None  # for tokenizer_config.json, when the files need one


# Hugging Face names the files of a slow tokenizer; a GPT2Tokenizer only finds vocab.json + merges.txt.
_HF_FILES = {
    "GPT2BPETokenizer": ({"vocab_file": "vocab.json", "merge_file": "merges.txt"}, "GPT2Tokenizer"),
    "Llama2Tokenizer": ({"tokenizer_model": "tokenizer.model"}, "LlamaTokenizer"),
    "GPTSentencePieceTokenizer": ({"tokenizer_model": "tokenizer.model"}, "LlamaTokenizer"),
    "HuggingFaceTokenizer": ({"tokenizer_model": None}, None),  # a directory: copied file by file
}


def _files(args) -> tuple[dict, str | None]:
    names, tokenizer_class = _HF_FILES.get(getattr(args, "tokenizer_type", None), ({}, None))
    files = {}
    for attribute, name in names.items():
        path = getattr(args, attribute, None)
        if path and os.path.exists(path):
            files[path] = name or os.path.basename(path)
    return files, tokenizer_class


def tokenizer_info(args: argparse.Namespace, true_vocab_size: int | None = None) -> TokenizerInfo:
    """The tokenizer of a checkpoint's `args`; `true_vocab_size` (--true-vocab-size) wins over the built one.

    A tokenizer whose files are gone gives no size (printed as a note) rather than an error: resharding
    does not need one.
    """
    from megatron.core.tokenizers import build_tokenizer

    files, tokenizer_class = _files(args)
    info = TokenizerInfo(vocab_size=true_vocab_size, files=files, tokenizer_class=tokenizer_class)
    if getattr(args, "tokenizer_type", None) is None:
        return info
    request = copy.copy(args)
    request.padded_vocab_size, request.rank = None, 1  # only the size is wanted: no padding, no log lines
    try:
        tokenizer = build_tokenizer(request)
    except (ValueError, OSError, ImportError) as error:
        print(f" note: cannot build the checkpoint's {args.tokenizer_type} tokenizer here ({error}); its vocabulary "
              "size comes from --true-vocab-size", flush=True)
        return info
    if info.vocab_size is None:
        info.vocab_size = tokenizer.vocab_size
    for attribute, target in (("bos", "bos_token_id"), ("eod", "eos_token_id")):
        try:
            value = getattr(tokenizer, attribute)
        except (AttributeError, NotImplementedError):
            continue
        setattr(info, target, value if isinstance(value, int) and value >= 0 else None)
    return info
