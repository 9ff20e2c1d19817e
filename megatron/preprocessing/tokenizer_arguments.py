"""`add_tokenizer_args(parser)`: Megatron-LM's tokenizer flags, names and defaults, in one group.

Both `tools/preprocess_data.py` and the training parser register this group, as in Megatron-LM. It lives
here, not with the training flags, because `tools/preprocess_data.py` must run without torch and importing
anything under `megatron.training` loads it; and not in `megatron.core.tokenizers`, which has no argparse.
"""

import argparse
import difflib

from megatron.core.tokenizers.build import TOKENIZER_TYPES

# Tokenizer types of Megatron-LM (current or past) and its forks that this project does not build.
_NOT_SUPPORTED = {
    "MultimodalTokenizer": "is not supported yet",
    "NullMultimodalTokenizer": "is not supported yet",
    "SFTTokenizer": "is not supported yet",
    "Llama3Tokenizer": "was removed from Megatron-LM; use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR",
    "MistralTokenizer": "was removed from Megatron-LM; use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR",
    "HFTokenizer": "is spelt HuggingFaceTokenizer (Megatron-DeepSpeed's name for it is HFTokenizer)",
}


def _tokenizer_type(value: str) -> str:
    """argparse `type`: a clearer message than "invalid choice" for known and misspelt names."""
    if value in TOKENIZER_TYPES:
        return value
    if value in _NOT_SUPPORTED:
        raise argparse.ArgumentTypeError(f"{value} {_NOT_SUPPORTED[value]}")
    close = difflib.get_close_matches(value, TOKENIZER_TYPES, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    raise argparse.ArgumentTypeError(f"{value!r} is not a tokenizer type; {hint}choose from {', '.join(TOKENIZER_TYPES)}")


def add_tokenizer_args(parser: argparse.ArgumentParser, vocab_padding: bool = True) -> argparse.ArgumentParser:
    """Adds the "tokenizer" flag group to `parser` and returns it.

    `vocab_padding=False` leaves out `--make-vocab-size-divisible-by`, which the training parser registers
    with the model-size flags, as Megatron-LM does.
    """
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=_tokenizer_type, default=None, choices=TOKENIZER_TYPES,
                       help="What type of tokenizer to use.")
    # `--vocab` is an alias: old tutorials pass it, and as a prefix it would be ambiguous (--vocab-size).
    group.add_argument("--vocab-file", "--vocab", dest="vocab_file", type=str, default=None,
                       help="Path to the vocab file (GPT-2 vocab.json or BERT vocab.txt).")
    group.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file (merges.txt).")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of additional vocabulary tokens <extra_id_i>. They are used for span masking "
                            "in the T5 model.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece .model, TikTokenizer .json rank file, or Hugging Face directory / hub id.")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of vocab before EOD or padding (NullTokenizer; TikTokenizer, default 2^17).")
    group.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"],
                       help="Which tiktoken pre-split pattern to use.")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="Number of special tokens in tiktoken tokenizer.")
    # --tiktoken-special-tokens: Megatron <= v0.14's name.
    group.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", dest="special_tokens", type=str,
                       nargs="+", default=None,
                       help='Special tokens: TikTokenizer\'s (must include "<unk>", "<s>", "</s>"), or tokens added '
                            "to a HuggingFaceTokenizer as additional special tokens.")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="NullTokenizer end-of-document id (default: vocab size - 1).")
    group.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                       help="NullTokenizer padding id (default -1: none).")
    group.add_argument("--padded-vocab-size", type=int, default=None,
                       help="Embedding rows; default: the vocab size padded by --make-vocab-size-divisible-by x TP.")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Allow a Hugging Face tokenizer to run code from its directory or hub repository.")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                       help="Do not add the Hugging Face tokenizer's special tokens (e.g. BOS) to each text.")
    # Megatron <= v0.16 spelling of today's default; accepted so that old command lines run.
    group.add_argument("--tokenizer-hf-include-special-tokens", dest="tokenizer_hf_no_include_special_tokens",
                       action="store_false", default=False, help=argparse.SUPPRESS)
    if vocab_padding:
        group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                           help="Pad the vocab size to be divisible by this value (times the TP size).")
    return parser
