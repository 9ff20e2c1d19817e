"""Train the vocabulary files that `GPT2BPETokenizer` and `BertWordPiece*` read, with `tokenizers`.

- GPT-2 style: byte-level BPE over the GPT-2 pre-split (`gpt2_bpe.py`), all 256 bytes in the alphabet,
  written as `vocab.json` + `merges.txt` with `<|endoftext|>` as the last id (as GPT-2's 50256).
- BERT style: WordPiece over BERT's basic splitting, written as `vocab.txt` beginning with
  `[PAD] [UNK] [CLS] [SEP] [MASK]`.
Texts are streamed into the Rust trainers, so the corpus never has to fit in memory. Each output file
appears complete or not at all (written under a temporary name in the output directory, then renamed).
"""

import json
import os
import tempfile
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from megatron.core.tokenizers.bert_wordpiece import MAX_INPUT_CHARS_PER_WORD
from megatron.core.tokenizers.gpt2_bpe import END_OF_TEXT

WORDPIECE_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_BYTE_ALPHABET_SIZE = 256


def train_gpt2_bpe(texts: Iterable[str], vocab_size: int, output_dir: str, show_progress: bool = False) -> int:
    """Writes `vocab.json` and `merges.txt` to `output_dir`; returns the vocabulary size.

    The BPE gets `vocab_size - 1` tokens (fewer if the corpus runs out of pairs to merge), then
    `<|endoftext|>` takes the next id.
    """
    if vocab_size < _BYTE_ALPHABET_SIZE + 1:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for a byte-level BPE: it needs the 256 byte tokens and "
            f"{END_OF_TEXT} ({_BYTE_ALPHABET_SIZE + 1} at least)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".train-tokenizer-") as scratch:
        tokenizer.model.save(scratch)
        vocab_path = os.path.join(scratch, "vocab.json")
        with open(vocab_path, encoding="utf-8") as file:
            vocab = json.load(file)
        vocab[END_OF_TEXT] = len(vocab)
        with open(vocab_path, "w", encoding="utf-8") as file:
            json.dump(dict(sorted(vocab.items(), key=lambda item: item[1])), file, ensure_ascii=False)
        os.replace(os.path.join(scratch, "merges.txt"), os.path.join(output_dir, "merges.txt"))
        os.replace(vocab_path, os.path.join(output_dir, "vocab.json"))
    return len(vocab)


def train_wordpiece(
    texts: Iterable[str], vocab_size: int, output_dir: str, lowercase: bool, show_progress: bool = False
) -> int:
    """Writes `vocab.txt` to `output_dir`; returns the vocabulary size."""
    if vocab_size <= len(WORDPIECE_SPECIAL_TOKENS):
        raise ValueError(f"--vocab-size {vocab_size} leaves no room beside {' '.join(WORDPIECE_SPECIAL_TOKENS)}")
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=WORDPIECE_SPECIAL_TOKENS,
        continuing_subword_prefix="##",
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".train-tokenizer-") as scratch:
        tokenizer.model.save(scratch)
        os.replace(os.path.join(scratch, "vocab.txt"), os.path.join(output_dir, "vocab.txt"))
    return tokenizer.get_vocab_size()
