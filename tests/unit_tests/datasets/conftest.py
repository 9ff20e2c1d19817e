"""Session fixtures of the BERT/T5 dataset tests: a trained WordPiece tokenizer and a sentence corpus."""

import pytest

from tests.unit_tests.datasets.masked_fixtures import (
    make_tokenizer,
    sentence_texts,
    tokenize_documents,
    write_sentence_dataset,
)


@pytest.fixture(scope="session")
def wordpiece_tokenizer(tmp_path_factory):
    """`BertWordPieceLowerCase` over a 300-piece vocabulary trained here, with 100 sentinels."""
    return make_tokenizer(str(tmp_path_factory.mktemp("wordpiece")))


@pytest.fixture(scope="session")
def sentence_corpus(tmp_path_factory, wordpiece_tokenizer):
    """`(prefix, documents)`: 200 documents of 1 to 10 sentences, as sentence-level `.bin/.idx`."""
    documents = tokenize_documents(wordpiece_tokenizer, sentence_texts(200, seed=3))
    prefix = write_sentence_dataset(str(tmp_path_factory.mktemp("sentences") / "corpus_text_sentence"), documents)
    return prefix, documents
