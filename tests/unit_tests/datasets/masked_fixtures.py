"""Sentence-level corpora and a WordPiece tokenizer for the BERT/T5 dataset tests.

The vocabulary is trained here (Hugging Face `tokenizers` WordPiece trainer) on words made of random
syllables, small enough that most words are split into `##` pieces; the tokenizer is Megatron's
`BertWordPieceLowerCase` with 100 `<extra_id_i>` sentinels. A corpus is written as
`preprocess_data.py --split-sentences` would: one sequence per sentence, one document per text.
"""

import os
import random

import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.split import Split
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig
from megatron.core.tokenizers.bert_wordpiece import BertWordPieceTokenizer

_SYLLABLES = "ka lo mi re tu sa ne po vi da gru ench ost alm ber iq zu".split()


def syllable_words(count: int, seed: int) -> list[str]:
    """`count` words of 1 to 4 random syllables."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def sentence_texts(num_documents: int, seed: int, max_sentences: int = 10, max_words: int = 18) -> list[list[str]]:
    """Documents as lists of sentences (`word word ... word.`) over a 400-word lexicon."""
    rng = random.Random(seed)
    lexicon = syllable_words(400, seed=7)
    return [
        [
            " ".join(rng.choice(lexicon) for _ in range(rng.randint(1, max_words))) + "."
            for _ in range(rng.randint(1, max_sentences))
        ]
        for _ in range(num_documents)
    ]


def train_wordpiece_vocab(directory: str) -> str:
    """A 300-token lower-case WordPiece `vocab.txt` ([PAD] = 0, then [UNK] [CLS] [SEP] [MASK])."""
    texts = [sentence for document in sentence_texts(300, seed=1) for sentence in document]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.save(directory)
    return os.path.join(directory, "vocab.txt")


def make_tokenizer(directory: str) -> BertWordPieceTokenizer:
    return BertWordPieceTokenizer(train_wordpiece_vocab(directory), lower_case=True, vocab_extra_ids=100)


def write_sentence_dataset(prefix: str, documents: list[list[list[int]]]) -> str:
    """`prefix.bin/.idx`: each document a run of sentence sequences (token-id lists)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for sentences in documents:
        tokens = [token for sentence in sentences for token in sentence]
        builder.add_document(np.array(tokens, dtype=np.int64), [len(sentence) for sentence in sentences])
    builder.finalize(prefix + ".idx")
    return prefix


def tokenize_documents(tokenizer, texts: list[list[str]]) -> list[list[list[int]]]:
    return [[tokenizer.tokenize(sentence) for sentence in document] for document in texts]


_MASKING = dict(
    masking_probability=0.15,
    short_sequence_probability=0.1,
    masking_do_full_word=True,
    masking_do_permutation=False,
    masking_use_longer_ngrams=False,
)


def bert_config(tokenizer, **overrides) -> BERTMaskedWordPieceDatasetConfig:
    """Megatron-LM's BERT settings (n-grams up to 3, P(n) proportional to 1/n) on a 64-token sequence."""
    settings = dict(
        random_seed=1234,
        sequence_length=64,
        tokenizer=tokenizer,
        masking_max_ngram=3,
        masking_use_geometric_distribution=False,
        classification_head=True,
        **_MASKING,
    )
    settings.update(overrides)
    return BERTMaskedWordPieceDatasetConfig(**settings)


def t5_config(tokenizer, **overrides) -> T5MaskedWordPieceDatasetConfig:
    """Megatron-LM's T5 settings (geometric span lengths up to 10) on 96 encoder / 48 decoder tokens."""
    settings = dict(
        random_seed=1234,
        sequence_length=96,
        sequence_length_decoder=48,
        tokenizer=tokenizer,
        masking_max_ngram=10,
        masking_use_geometric_distribution=True,
        **_MASKING,
    )
    settings.update(overrides)
    return T5MaskedWordPieceDatasetConfig(**settings)


def build_dataset(dataset_class, config_function, corpus, tokenizer, cache_directory, num_samples, **overrides):
    """`dataset_class` over the whole of `corpus` as the train split."""
    prefix, documents = corpus
    config = config_function(
        tokenizer, blend=([prefix], None), split="1,0,0", path_to_cache=str(cache_directory), **overrides
    )
    indices = np.arange(len(documents), dtype=np.int32)
    return dataset_class(IndexedDataset(prefix), prefix, indices, num_samples, Split.train, config)
