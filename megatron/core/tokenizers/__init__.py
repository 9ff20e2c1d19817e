"""Megatron-LM's tokenizers: `--tokenizer-type` names, files, ids and special tokens.

`build_tokenizer(args)` reads the attributes that the tokenizer flags set (declared, with argparse, by
`megatron.preprocessing.tokenizer_arguments`). Imports neither torch nor anything of megatron outside this
package, so that `tools/preprocess_data.py` runs on a machine without torch. The optional back ends
(sentencepiece, tiktoken, transformers) are imported only when a tokenizer that needs one is built.
"""

from megatron.core.tokenizers.bert_wordpiece import BertWordPieceTokenizer
from megatron.core.tokenizers.build import (
    TOKENIZER_TYPES,
    build_tokenizer,
    construct_tokenizer,
    padded_vocab_size,
    vocab_size_with_padding,
)
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer, MissingTokenizerAttribute
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizers.tiktoken_tokenizer import TikTokenizer

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
    "build_tokenizer",
    "construct_tokenizer",
    "padded_vocab_size",
    "vocab_size_with_padding",
]
