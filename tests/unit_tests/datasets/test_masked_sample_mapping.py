"""The BERT/T5 sample mapping: hand-worked examples and a loop transcription of
helpers.cpp `build_mapping`."""

import numpy as np
import pytest

from megatron.core.datasets import masked_sample_mapping
from megatron.core.datasets.masked_sample_mapping import build_mapping
from tests.unit_tests.datasets import cpp_mapping_reference


def boundaries(*documents):
    """(`documents` boundaries, `sizes`) of documents given as lists of sentence lengths."""
    counts = [len(document) for document in documents]
    sizes = np.array([size for document in documents for size in document], dtype=np.int32)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), sizes


def rows(documents, sizes, short_seq_prob=0.0, min_num_sent=1, num_samples=None, epochs=1, seed=5489):
    """The mapping's rows (max_seq_length 10) as a sorted list; the order is the shuffle's, tested
    against the C++ loop."""
    mapping = build_mapping(documents, sizes, epochs, num_samples, 10, short_seq_prob, seed, False, min_num_sent)
    return sorted(map(tuple, mapping.tolist()))


def test_full_length_samples_cut_where_two_sentences_remain():
    # 3+2+4 = 9 < 10, +1 = 10 at sentence 3 with two sentences left: (0, 4). Then 5+2 runs to the end.
    # The second document reaches 10 only at its last sentence: one sample.
    documents, sizes = boundaries([3, 2, 4, 1, 5, 2], [2, 2, 2, 2, 2])
    assert rows(documents, sizes) == [(0, 4, 10), (4, 6, 10), (6, 11, 10)]
    # The module docstring's example: 4+3+5 >= 10 with two sentences left, then 2+6 to the end.
    assert rows(*boundaries([4, 3, 5, 2, 6])) == [(0, 3, 10), (3, 5, 10)]


def test_short_targets_from_the_mt19937_stream():
    # seed 5489 draws 3499211612, 581869302, 3890346734, 3586334585, ... short_seq_prob 0.5 -> ratio 2:
    # an even draw r gives the target 2 + r % 9 (digit sums: 38, 42, 47 -> r % 9 = 2, 6, 2), an odd one 10.
    # Document 0: target 4 -> 3+2 >= 4 with 4 sentences left: (0, 2, 4); next draw 8 -> 4+1+5 >= 8 at
    # sentence 4 but only one sentence would remain, so it runs to the end: (2, 6, 8); the draw after
    # the last sample (4) is spent unused. The empty document draws nothing. Document 2 gets the fourth
    # draw, 3586334585 (odd -> 10): (6, 11, 10).
    documents, sizes = boundaries([3, 2, 4, 1, 5, 2], [], [2, 2, 2, 2, 2])
    assert rows(documents, sizes, short_seq_prob=0.5) == [(0, 2, 4), (2, 6, 8), (6, 11, 10)]


def test_short_seq_prob_rounds_its_ratio_like_c():
    # round(1 / 0.4) = round(2.5) = 3 in C (half away from zero; Python's round gives 2): the first
    # draws 3499211612, 581869302 are 2, 0 mod 3, so only the second is short: 2 + 6. Target 10 ends
    # the first sample at sentence 3 (3+2+4+1); target 8 is reached at sentence 6 with one sentence
    # left, so the second runs to the end. (With ratio 2 the first draw would give 4.)
    documents, sizes = boundaries([3, 2, 4, 1, 5, 2, 9, 1])
    assert rows(documents, sizes, short_seq_prob=0.4) == [(0, 4, 10), (4, 8, 8)]


def test_two_sentences_per_sample_with_the_binary_head():
    # min_num_sent 2: the one-sentence document is skipped, the 10-token first sentence alone is not
    # a sample; with min_num_sent 1 both change.
    documents, sizes = boundaries([7], [10, 1, 1, 10])
    assert rows(documents, sizes, min_num_sent=2) == [(1, 3, 10), (3, 5, 10)]
    assert rows(documents, sizes, min_num_sent=1) == [(0, 1, 10), (1, 2, 10), (2, 5, 10)]


def test_skipped_documents_draw_no_target():
    # The first two draws (targets 4, 8) go to the second document: the skipped one drew nothing.
    documents, sizes = boundaries([7], [10, 1, 1, 10])
    assert rows(documents, sizes, short_seq_prob=0.5, min_num_sent=2) == [(1, 3, 4), (3, 5, 8)]


def test_documents_with_a_sentence_over_512_tokens_are_skipped_unless_single():
    documents, sizes = boundaries([600], [5, 600], [513, 2, 3], [512, 3])
    assert rows(documents, sizes) == [(0, 1, 10), (6, 8, 10)]
    assert rows(documents, sizes, min_num_sent=2) == [(6, 8, 10)]


def test_whole_epochs_until_the_requested_samples():
    documents, sizes = boundaries([3, 2, 4, 1, 5, 2])  # two samples per epoch
    one_epoch = [(0, 4, 10), (4, 6, 10)]
    assert rows(documents, sizes, num_samples=0, epochs=100) == []
    assert rows(documents, sizes, num_samples=1, epochs=100) == one_epoch
    assert rows(documents, sizes, num_samples=4, epochs=100) == sorted(one_epoch * 2)
    assert rows(documents, sizes, num_samples=5, epochs=100) == sorted(one_epoch * 3)
    assert rows(documents, sizes, num_samples=None, epochs=2) == sorted(one_epoch * 2)


def test_the_mapping_is_split_local_with_global_sentence_ids():
    # A split that starts at document 2 keeps the dataset's sentence ids.
    documents, sizes = boundaries([4, 4], [1, 1], [3, 2, 4, 1, 5, 2])
    assert rows(documents[2:], sizes) == [(4, 8, 10), (8, 10, 10)]


@pytest.mark.parametrize("case", range(40))
def test_equals_the_cpp_loop(case):
    rng = np.random.default_rng(case)
    counts = rng.integers(0, 12, int(rng.integers(1, 30)))
    offset = int(rng.integers(0, 4))
    sizes = rng.integers(0, 40, int(counts.sum()) + offset + 2).astype(np.int32)
    sizes[rng.random(len(sizes)) < 0.03] = 600
    documents = (np.concatenate([[0], np.cumsum(counts)]) + offset).astype(np.int64)
    max_seq_length = int(rng.integers(2, 60))
    short_seq_prob = float(rng.choice([0.0, 0.1, 0.25, 0.4, 0.5, 1.0, 0.03]))
    seed = int(rng.integers(1, 100000))
    min_num_sent = int(rng.choice([1, 2]))
    num_samples = int(rng.integers(0, 150))
    expected = cpp_mapping_reference.build_mapping(
        documents, sizes, 50, num_samples, max_seq_length, short_seq_prob, seed, min_num_sent
    )
    if num_samples > 0 and len(expected) == 0:
        with pytest.raises(ValueError, match="no sample can be made"):
            build_mapping(documents, sizes, 50, num_samples, max_seq_length, short_seq_prob, seed, False, min_num_sent)
        return
    actual = build_mapping(documents, sizes, 50, num_samples, max_seq_length, short_seq_prob, seed, False, min_num_sent)
    assert actual.dtype == np.uint32 and actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


def test_equals_the_cpp_loop_across_walk_blocks_and_draw_windows(monkeypatch):
    # Small blocks and windows so that documents and draws cross their boundaries many times.
    monkeypatch.setattr(masked_sample_mapping, "_DOCUMENTS_PER_BLOCK", 7)
    monkeypatch.setattr(masked_sample_mapping, "_DRAWS_PER_WINDOW", 5)
    rng = np.random.default_rng(5)
    counts = rng.integers(1, 9, 3000)
    sizes = rng.integers(1, 30, int(counts.sum())).astype(np.int32)
    documents = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    expected = cpp_mapping_reference.build_mapping(documents, sizes, 1000, 12000, 40, 0.1, 4321, 2)
    np.testing.assert_array_equal(build_mapping(documents, sizes, 1000, 12000, 40, 0.1, 4321, False, 2), expected)


def test_invalid_arguments_are_refused_with_the_flag():
    documents, sizes = boundaries([3, 4])
    with pytest.raises(ValueError, match=r"seed \(--seed\)"):
        build_mapping(documents, sizes, 1, None, 10, 0.1, 0, False, 1)
    with pytest.raises(ValueError, match=r"--short-seq-prob"):
        build_mapping(documents, sizes, 1, None, 10, 1.5, 1, False, 1)
    with pytest.raises(ValueError, match="max_seq_length"):
        build_mapping(documents, sizes, 1, None, 1, 0.1, 1, False, 1)


def test_no_usable_document_is_an_error_not_an_endless_loop():
    documents, sizes = boundaries([5], [], [2])
    with pytest.raises(ValueError, match="1 empty, 2 with one sentence"):
        build_mapping(documents, sizes, 2**31 - 2, 10, 10, 0.1, 1, False, 2)
