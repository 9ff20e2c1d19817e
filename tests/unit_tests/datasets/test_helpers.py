"""Vectorised index helpers against worked examples of Megatron's compiled helpers.cpp and a loop transcription."""

import numpy as np
import pytest

from megatron.core.datasets import helpers
from tests.unit_tests.datasets import cpp_reference


def test_sample_index_worked_example():
    # Megatron's build_sample_idx: sizes [7, 5, 2, 3] in document order, seq_len 4 -> 4 samples of 5 tokens.
    sizes = np.array([7, 5, 2, 3], dtype=np.int32)
    sample_index = helpers.build_sample_idx(sizes, np.arange(4, dtype=np.int32), 4, 1, 17)
    assert sample_index.tolist() == [[0, 0], [0, 4], [1, 1], [2, 0], [3, 2]]
    assert sample_index.dtype == np.int32


def test_sample_index_keeps_the_last_partial_sample():
    # 17 tokens, seq 5: ceil(16 / 5) = 4 samples, the last runs out at (last document, size - 1).
    sizes = np.array([7, 5, 2, 3], dtype=np.int32)
    sample_index = helpers.build_sample_idx(sizes, np.arange(4, dtype=np.int32), 5, 1, 17, False)
    assert sample_index.tolist() == [[0, 0], [0, 5], [1, 3], [3, 1], [3, 2]]


@pytest.mark.parametrize("seed", range(40))
def test_sample_index_matches_cpp_loop(seed):
    rng = np.random.default_rng(seed)
    num_documents = int(rng.integers(1, 40))
    sizes = rng.integers(0, 30, num_documents).astype(np.int32)
    sizes[rng.random(num_documents) < 0.2] = 0  # zero-length documents
    if sizes.sum() < 2:
        sizes[0] = 2
    num_epochs = int(rng.integers(1, 4))
    document_index = np.tile(np.arange(num_documents, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    tokens_per_epoch = int(sizes.sum())
    sequence_length = int(rng.integers(2, 20))
    for drop_last in (True, False):
        for extra in (0, 1):
            for dtype in (np.int32, np.int64):
                expected = cpp_reference.build_sample_idx(
                    sizes, document_index, sequence_length, num_epochs, tokens_per_epoch, drop_last, extra, dtype
                )
                actual = helpers.build_sample_idx(
                    sizes, document_index, sequence_length, num_epochs, tokens_per_epoch, drop_last, bool(extra), dtype
                )
                assert actual.dtype == dtype
                np.testing.assert_array_equal(actual, expected)


def test_sample_index_ending_on_an_empty_document_runs_out_like_the_cpp():
    sizes = np.array([6, 0], dtype=np.int32)
    document_index = np.array([0, 1], dtype=np.int32)
    expected = cpp_reference.build_sample_idx(sizes, document_index, 4, 1, 6, False, 1, np.int32)
    np.testing.assert_array_equal(helpers.build_sample_idx(sizes, document_index, 4, 1, 6, False), expected)
    assert expected[-1].tolist() == [1, -1]


def test_sample_index_rejects_what_the_cpp_asserts():
    sizes = np.array([5], dtype=np.int32)
    with pytest.raises(ValueError, match="sequence_length > 1"):
        helpers.build_sample_idx(sizes, np.zeros(1, np.int32), 1, 1, 5)


def test_blending_worked_example():
    # Megatron's build_blending_indices: w = [.3, .7], 10 samples.
    dataset_index = np.zeros(10, dtype=np.int16)
    dataset_sample_index = np.zeros(10, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, np.array([0.3, 0.7]), 2, 10, False)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert dataset_sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


def _blending_cases():
    rng = np.random.default_rng(0)
    cases = [np.array(w) / np.sum(w) for w in ([0.5, 0.5], [1, 1, 1], [1, 1, 2], [0.3, 0.7], [1] * 10)]
    for num_datasets in (1, 2, 3, 5, 12, 40):
        weights = rng.random(num_datasets) ** 2
        cases.append(weights / weights.sum())
    return [(weights, size) for weights, size in zip(cases, [997, 5000, 12000, 3001, 20000, 64, 18000, 9000, 15000, 7000, 4000])]


@pytest.mark.parametrize("weights,size", _blending_cases())
def test_blending_matches_cpp_loop(weights, size):
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
    expected_index, expected_sample_index = cpp_reference.build_blending_indices(weights, size)
    np.testing.assert_array_equal(dataset_index, expected_index)
    np.testing.assert_array_equal(dataset_sample_index, expected_sample_index)


@pytest.mark.parametrize("sizes", [[3, 5], [1], [7, 7, 7], [100, 1, 2000], [4000, 2500, 900, 3100, 77], list(range(1, 30))])
def test_exhaustive_blending_matches_cpp_loop(sizes):
    total = sum(sizes)
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index, np.array(sizes), len(sizes))
    expected_index, expected_sample_index = cpp_reference.build_exhaustive_blending_indices(sizes)
    np.testing.assert_array_equal(dataset_index, expected_index)
    np.testing.assert_array_equal(dataset_sample_index, expected_sample_index)
    assert np.bincount(dataset_index).tolist() == sizes


def test_exhaustive_blending_rejects_an_empty_dataset():
    with pytest.raises(ValueError, match="at least one sample"):
        helpers.build_exhaustive_blending_indices(np.zeros(3, np.int16), np.zeros(3, np.int64), np.array([3, 0]), 2)


def test_blending_rejects_wrong_output_dtypes():
    with pytest.raises(ValueError, match="int16 and int64"):
        helpers.build_blending_indices(np.zeros(4, np.int32), np.zeros(4, np.int64), np.array([0.5, 0.5]), 2, 4, False)
