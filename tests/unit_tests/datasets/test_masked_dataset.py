"""MaskedWordPieceDataset: n-gram length distributions, whole-word masking, permutation, configuration
checks, index caching and splits by document, as Megatron-LM's masked_dataset.py does them."""

import json
import math
import os
import shutil

import numpy as np
import pytest

from megatron.core.datasets import masked_dataset
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import md5_hex
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
from tests.unit_tests.datasets.gpt_fixtures import StubTokenizer
from tests.unit_tests.datasets.masked_fixtures import bert_config, build_dataset, t5_config


@pytest.fixture
def bert_factory(sentence_corpus, wordpiece_tokenizer, tmp_path):
    def make(num_samples=300, **overrides):
        return build_dataset(
            BERTMaskedWordPieceDataset, bert_config, sentence_corpus, wordpiece_tokenizer, tmp_path, num_samples,
            **overrides,
        )

    return make


def whole_word_ids(tokenizer, count):
    """`count` ids of tokens that are whole words (no `##`, not special)."""
    specials = {tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask}
    ids = [i for i, token in tokenizer.inv_vocab.items() if token.isalpha() and i not in specials]
    return [ids[i % len(ids)] for i in range(count)]


def first_span_lengths(dataset, tokens, trials, max_ngram):
    """Length (in words) of the span masked from the first word start that the sample's random state
    visits, over `trials` seeds. That span is drawn before anything is masked, so it is the drawn n-gram
    length, unless the n-gram runs past the end (those trials are left out)."""
    lengths = []
    for seed in range(trials):
        order = list(range(len(tokens)))
        np.random.RandomState(seed).shuffle(order)  # the first draw of the masking: the visiting order
        first = order[0]
        if first > len(tokens) - max_ngram:
            continue
        _, _, _, _, spans = dataset._create_masked_lm_predictions(tokens, len(tokens), np.random.RandomState(seed))
        (span,) = [positions for positions, _ in spans if positions[0] == first]
        lengths.append(len(span))
    return np.array(lengths)


def assert_distribution(lengths, probabilities):
    """Each length's frequency within 4 standard errors of its probability."""
    for length, probability in enumerate(probabilities, start=1):
        frequency = np.mean(lengths == length)
        tolerance = 4 * math.sqrt(probability * (1 - probability) / len(lengths))
        assert abs(frequency - probability) < tolerance, (length, frequency, probability)


@pytest.mark.parametrize("longer", [False, True])
def test_bert_ngram_lengths_are_proportional_to_one_over_n(bert_factory, wordpiece_tokenizer, longer):
    dataset = bert_factory(masking_use_longer_ngrams=longer)
    lengths = first_span_lengths(dataset, whole_word_ids(wordpiece_tokenizer, 80), 2500, 3)
    probabilities = [6 / 11, 3 / 11, 2 / 11]  # 1/n normalised over n = 1, 2, 3
    assert_distribution(lengths, probabilities[::-1] if longer else probabilities)


def test_t5_span_lengths_are_geometric_clipped_at_ten(sentence_corpus, wordpiece_tokenizer, tmp_path):
    dataset = build_dataset(T5MaskedWordPieceDataset, t5_config, sentence_corpus, wordpiece_tokenizer, tmp_path, 10)
    lengths = first_span_lengths(dataset, whole_word_ids(wordpiece_tokenizer, 80), 2500, 10)
    # SpanBERT: P(n) = 0.2 * 0.8^(n-1), with all of P(n >= 10) on 10; mean = sum_{k<10} 0.8^k = 4.463.
    probabilities = [0.2 * 0.8 ** (n - 1) for n in range(1, 10)] + [0.8**9]
    assert_distribution(lengths, probabilities)
    mean = sum(n * p for n, p in enumerate(probabilities, start=1))
    deviation = math.sqrt(sum((n - mean) ** 2 * p for n, p in enumerate(probabilities, start=1)))
    assert mean == pytest.approx((1 - 0.8**10) / 0.2)
    assert abs(lengths.mean() - mean) < 4 * deviation / math.sqrt(len(lengths))


def _masked_word_splits(dataset, tokenizer, samples):
    """How many masked words had some pieces left unmasked, over `samples` samples. (A `##` piece
    right after [CLS]/[SEP], left by truncation, is no continuation of the token before.)"""
    continuation = {i for i, token in tokenizer.inv_vocab.items() if token.startswith("##")}
    specials = (tokenizer.cls, tokenizer.sep)
    splits = 0
    for idx in range(samples):
        sample = dataset[idx]
        length = int(sample["padding_mask"].sum())
        masked = sample["loss_mask"][:length] == 1
        original = np.where(masked, sample["labels"][:length], sample["text"][:length])
        for position in range(1, length):
            within_word = original[position] in continuation and original[position - 1] not in specials
            if within_word and masked[position] != masked[position - 1]:
                splits += 1
    return splits


def test_whole_word_masking_never_splits_a_word(bert_factory, wordpiece_tokenizer):
    assert _masked_word_splits(bert_factory(), wordpiece_tokenizer, 300) == 0
    # The check does see splits when pieces are masked on their own.
    assert _masked_word_splits(bert_factory(masking_do_full_word=False), wordpiece_tokenizer, 300) > 20


def test_permutation_shuffles_further_ngrams_among_themselves(bert_factory, wordpiece_tokenizer):
    dataset = bert_factory(masking_do_permutation=True)
    tokens = whole_word_ids(wordpiece_tokenizer, 60)[::-1] + whole_word_ids(wordpiece_tokenizer, 40)
    permuted_any = 0
    for seed in range(40):
        masked_ids, positions, labels, _, spans = dataset._create_masked_lm_predictions(
            tokens, len(tokens), np.random.RandomState(seed)
        )
        masked_positions = {position for span, _ in spans for position in span}
        permuted = sorted(set(positions) - masked_positions)
        assert labels == [tokens[position] for position in positions]
        assert len(masked_positions) <= 15 and len(permuted) <= 15  # budget: 15% of 100 tokens
        assert sorted(masked_ids[p] for p in permuted) == sorted(tokens[p] for p in permuted)
        untouched = set(range(len(tokens))) - set(positions)
        assert all(masked_ids[p] == tokens[p] for p in untouched)
        permuted_any += any(masked_ids[p] != tokens[p] for p in permuted)
        again = dataset._create_masked_lm_predictions(tokens, len(tokens), np.random.RandomState(seed))
        assert again[0] == masked_ids  # reproducible: every draw comes from the sample's state
    assert permuted_any > 30


def test_config_reports_every_problem_at_once():
    with pytest.raises(ValueError) as error:
        masked_dataset.MaskedWordPieceDatasetConfig(random_seed=0, sequence_length=16, tokenizer=StubTokenizer())
    message = str(error.value)
    for expected in ("masking_probability is required", "masking_use_geometric_distribution is required",
                     "lacks inv_vocab, cls, sep, mask, pad", "random_seed (--seed) must be in [1"):
        assert expected in message


def test_config_checks_ranges(wordpiece_tokenizer):
    with pytest.raises(ValueError, match=r"--mask-prob\) must be in \(0, 1\)"):
        bert_config(wordpiece_tokenizer, masking_probability=1.0)
    with pytest.raises(ValueError, match="exclusive"):
        bert_config(wordpiece_tokenizer, masking_use_geometric_distribution=True, masking_do_permutation=True)
    with pytest.raises(ValueError, match="--short-seq-prob"):
        bert_config(wordpiece_tokenizer, short_sequence_probability=-0.1)


def test_splits_count_documents_and_mock_data_is_refused(sentence_corpus, wordpiece_tokenizer):
    prefix, documents = sentence_corpus
    low_level = BERTMaskedWordPieceDataset.build_low_level_dataset(prefix, bert_config(wordpiece_tokenizer))
    assert BERTMaskedWordPieceDataset.numel_low_level_dataset(low_level) == len(documents) == 200
    assert len(low_level) == sum(len(document) for document in documents)  # sequences are sentences
    with pytest.raises(ValueError, match="--mock-data"):
        T5MaskedWordPieceDataset.build_low_level_dataset(None, t5_config(wordpiece_tokenizer))


def test_builder_splits_by_document(sentence_corpus, wordpiece_tokenizer, tmp_path):
    prefix, documents = sentence_corpus
    config = bert_config(wordpiece_tokenizer, blend=([prefix], None), split="60,20,20", path_to_cache=str(tmp_path))
    datasets = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [400, 50, 50], lambda: True, config).build()
    boundaries = np.concatenate([[0], np.cumsum([len(document) for document in documents])])
    for dataset, (first_document, last_document) in zip(datasets, [(0, 120), (120, 160), (160, 200)]):
        assert dataset.indices.tolist() == list(range(first_document, last_document))
        rows = np.asarray(dataset.sample_index)
        assert (rows[:, 0] >= boundaries[first_document]).all() and (rows[:, 1] <= boundaries[last_document]).all()
        # Every document of two or more sentences (none has a sentence over 512 tokens) gives samples.
        used = {int(np.searchsorted(boundaries, start, side="right")) - 1 for start in rows[:, 0]}
        assert used == {d for d in range(first_document, last_document) if len(documents[d]) >= 2}
    assert len(datasets[0]) >= 400 and len(datasets[1]) >= 50


def test_sample_index_is_cached_under_megatron_names(bert_factory, monkeypatch, tmp_path):
    dataset = bert_factory()
    description = dataset.unique_description
    base = os.path.join(str(tmp_path), f"{md5_hex(description)}-BERTMaskedWordPieceDataset")
    with open(base + "-description.txt") as file:
        assert file.read() == description
    assert list(json.loads(description)) == [
        "class", "dataset_path", "num_samples", "index_split", "random_seed", "sequence_length", "split",
        "split_matrix", "tokenizer", "masking_probability", "short_sequence_probability", "masking_max_ngram",
        "masking_do_full_word", "masking_do_permutation", "masking_use_longer_ngrams",
        "masking_use_geometric_distribution", "classification_head",
    ]
    np.testing.assert_array_equal(np.load(base + "-sample_index.npy"), dataset.sample_index)

    def no_build(*args, **kwargs):
        raise AssertionError("the cached sample index should have been loaded")

    monkeypatch.setattr(masked_dataset, "build_mapping", no_build)
    np.testing.assert_array_equal(bert_factory().sample_index, dataset.sample_index)
    with pytest.raises(AssertionError, match="should have been loaded"):
        bert_factory(classification_head=False)  # another description: another cache entry


def test_default_cache_directory_is_next_to_the_data(sentence_corpus, wordpiece_tokenizer, tmp_path):
    prefix, documents = sentence_corpus
    copy = str(tmp_path / "corpus_text_sentence")
    for extension in (".bin", ".idx"):
        shutil.copy(prefix + extension, copy + extension)
    config = t5_config(wordpiece_tokenizer, blend=([copy], None), split="1,0,0")
    indices = np.arange(len(documents))
    dataset = T5MaskedWordPieceDataset(IndexedDataset(copy), copy, indices, None, masked_dataset.Split.train, config)
    directory = os.path.join(copy, "cache", "T5MaskedWordPieceDataset_indices")
    base = f"{dataset.unique_description_hash}-T5MaskedWordPieceDataset"
    assert sorted(os.listdir(directory)) == [f"{base}-description.txt", f"{base}-sample_index.npy"]
    assert "sequence_length_decoder" in json.loads(dataset.unique_description)
