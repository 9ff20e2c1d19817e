"""Megatron-LM's tokenizers: `--tokenizer-type` names, flags, ids and special tokens.

Imports neither torch nor anything of megatron outside this package, so that `tools/preprocess_data.py`
runs on a machine without torch. The optional back ends (sentencepiece, tiktoken, transformers) are
imported only when a tokenizer that needs one is built.
"""

from megatron.training.tokenizer.arguments import add_tokenizer_args
from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.training.tokenizer.build import TOKENIZER_TYPES, build_tokenizer, vocab_size_with_padding
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.training.tokenizer.megatron_tokenizer import MegatronTokenizer, MissingTokenizerAttribute
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.tiktoken_tokenizer import TikTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "MegatronTokenizer",
    "MissingTokenizerAttribute",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "add_tokenizer_args",
    "build_tokenizer",
    "vocab_size_with_padding",
]
