"""BERTMaskedWordPieceDataset: samples equal to Megatron-LM's draw for draw, their layout, sentence order
prediction and the 80/10/10 replacement rates (Megatron-LM's `_create_masked_lm_predictions`)."""

import math

import numpy as np
import pytest

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from tests.unit_tests.datasets import megatron_masking_reference
from tests.unit_tests.datasets.masked_fixtures import bert_config, build_dataset


def bert_dataset(corpus, tokenizer, tmp_path, num_samples=1000, **overrides):
    return build_dataset(BERTMaskedWordPieceDataset, bert_config, corpus, tokenizer, tmp_path, num_samples, **overrides)


@pytest.fixture(scope="module")
def epoch(sentence_corpus, wordpiece_tokenizer, tmp_path_factory):
    """(dataset, all its samples): one epoch (about 1200 samples) of the default settings."""
    dataset = bert_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path_factory.mktemp("bert_epoch"))
    return dataset, [dataset[idx] for idx in range(len(dataset))]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"classification_head": False},
        {"sequence_length": 24, "short_sequence_probability": 0.3},  # most samples truncated
        {"masking_use_longer_ngrams": True, "masking_do_full_word": False},
        {"masking_use_geometric_distribution": True},  # Megatron-LM's examples/bert/pretrain_bert.py
    ],
)
def test_samples_equal_megatron_draw_for_draw(sentence_corpus, wordpiece_tokenizer, tmp_path, overrides):
    dataset = bert_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path, num_samples=300, **overrides)
    for idx in range(300):
        expected = megatron_masking_reference.bert_getitem(dataset.dataset, dataset.sample_index, dataset.config, idx)
        sample = dataset[idx]
        assert sample.keys() == expected.keys()
        for key, value in expected.items():
            np.testing.assert_array_equal(sample[key], value, err_msg=f"sample {idx}, {key}")


def test_keys_shapes_and_dtypes(sentence_corpus, wordpiece_tokenizer, tmp_path):
    dataset = bert_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path)
    sample = dataset[0]
    assert list(sample) == ["text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated"]
    for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
        assert sample[key].shape == (64,) and sample[key].dtype == np.int64, key
    assert type(sample["is_random"]) is int and type(sample["truncated"]) is int


def _layout(dataset, idx, tokenizer):
    """(sample, original ids, segment A, segment B) with the masked ids put back."""
    sample = dataset[idx]
    length = int(sample["padding_mask"].sum())
    original = np.where(sample["loss_mask"] == 1, sample["labels"], sample["text"])[:length].tolist()
    separators = [position for position, token in enumerate(original) if token == tokenizer.sep]
    segment_a = original[1 : separators[0]]
    segment_b = original[separators[0] + 1 : separators[1]] if len(separators) > 1 else []
    return sample, original, segment_a, segment_b


def test_cls_a_sep_b_sep_from_the_sample_sentences(sentence_corpus, wordpiece_tokenizer, tmp_path):
    tokenizer = wordpiece_tokenizer
    dataset = bert_dataset(sentence_corpus, tokenizer, tmp_path)
    swapped = 0
    for idx in range(400):
        sample, original, segment_a, segment_b = _layout(dataset, idx, tokenizer)
        first, last, target = (int(value) for value in dataset.sample_index[idx])
        sentences = [dataset.dataset[i].tolist() for i in range(first, last)]
        length = len(original)
        assert original[0] == tokenizer.cls and original[-1] == tokenizer.sep and segment_b
        assert sample["types"].tolist() == [0] * (len(segment_a) + 2) + [1] * (len(segment_b) + 1) + [0] * (64 - length)
        assert sample["padding_mask"].tolist() == [1] * length + [0] * (64 - length)
        assert (sample["text"][length:] == tokenizer.pad).all()
        assert len(segment_a) + len(segment_b) <= target
        if sample["truncated"]:
            continue
        # Untruncated: the two segments are the sentences cut at a sentence boundary, maybe swapped.
        first_part, second_part = (segment_b, segment_a) if sample["is_random"] else (segment_a, segment_b)
        swapped += sample["is_random"]
        assert first_part + second_part == [token for sentence in sentences for token in sentence]
        assert len(first_part) in np.cumsum([len(sentence) for sentence in sentences[:-1]]).tolist()
    assert swapped > 0


def test_truncation_drops_from_the_ends_of_the_longer_segment(sentence_corpus, wordpiece_tokenizer, tmp_path):
    dataset = bert_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path, sequence_length=24)
    truncated = 0
    for idx in range(200):
        sample, _, segment_a, segment_b = _layout(dataset, idx, wordpiece_tokenizer)
        first, last, target = (int(value) for value in dataset.sample_index[idx])
        text = [token for i in range(first, last) for token in dataset.dataset[i].tolist()]
        assert len(segment_a) + len(segment_b) <= target <= 21
        assert bool(sample["truncated"]) == (len(text) > target)
        truncated += sample["truncated"]
        for segment in (segment_a, segment_b):  # a contiguous piece of the text
            assert any(text[start : start + len(segment)] == segment for start in range(len(text) - len(segment) + 1))
    assert truncated > 100


def test_without_the_binary_head_there_is_one_segment(sentence_corpus, wordpiece_tokenizer, tmp_path):
    dataset = bert_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path, classification_head=False)
    for idx in range(100):
        sample, original, segment_a, segment_b = _layout(dataset, idx, wordpiece_tokenizer)
        assert segment_b == [] and sample["is_random"] == 0
        assert (sample["types"] == 0).all()


def test_sentence_order_prediction_swaps_half_of_the_samples(epoch):
    _, samples = epoch
    swapped = np.array([sample["is_random"] for sample in samples])
    tolerance = 4 * 0.5 / math.sqrt(len(swapped))  # 4 standard errors of a fair coin's mean
    assert abs(swapped.mean() - 0.5) < tolerance


def test_masked_tokens_become_mask_80_random_10_unchanged_10(epoch, wordpiece_tokenizer):
    tokenizer = wordpiece_tokenizer
    dataset, samples = epoch
    text, labels, masked, budgets, lengths = [], [], 0, 0, 0
    for idx, sample in enumerate(samples):
        positions = sample["loss_mask"] == 1
        assert (sample["labels"][~positions] == -1).all()
        text.append(sample["text"][positions])
        labels.append(sample["labels"][positions])
        # Megatron's masking budget: min(p * target, max(1, round(p * tokens))), [CLS]/[SEP] counted.
        length, target = int(sample["padding_mask"].sum()), int(dataset.sample_index[idx][2])
        budget = math.floor(min(0.15 * target, max(1, round(0.15 * length))))
        assert positions.sum() <= budget
        masked += int(positions.sum())
        budgets += budget
        lengths += length
    text, labels = np.concatenate(text), np.concatenate(labels)
    vocabulary = len(tokenizer.inv_vocab)
    # A random replacement is uniform over the vocabulary, so it may hit [MASK] or the token itself.
    expected = {
        "mask": 0.8 + 0.1 / vocabulary,
        "unchanged": 0.1 + 0.1 / vocabulary,
        "other": 0.1 * (1 - 2 / vocabulary),
    }
    observed = {
        "mask": np.mean(text == tokenizer.mask),
        "unchanged": np.mean(text == labels),
        "other": np.mean((text != tokenizer.mask) & (text != labels)),
    }
    for name, probability in expected.items():
        tolerance = 4 * math.sqrt(probability * (1 - probability) / len(text))
        assert abs(observed[name] - probability) < tolerance, (name, observed[name], probability)
    # The budgets are 15% of the tokens, less the rounding down of p * target (0.15 * 61 = 9.15 -> 9),
    # and they are filled (a slot stays empty only when no unmasked word fits in it).
    assert 0.135 < budgets / lengths < 0.15
    assert 0.97 < masked / budgets <= 1


def test_config_requires_the_head_choice_and_room_for_special_tokens(wordpiece_tokenizer):
    with pytest.raises(ValueError) as error:
        bert_config(wordpiece_tokenizer, classification_head=None, sequence_length=4)
    assert "classification_head" in str(error.value) and "at least 5" in str(error.value)
    assert isinstance(bert_config(wordpiece_tokenizer), BERTMaskedWordPieceDatasetConfig)
