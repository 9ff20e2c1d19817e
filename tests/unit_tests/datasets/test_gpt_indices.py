"""Document/sample/shuffle index construction against a transcription of Megatron-LM's
`GPTDataset._build_document_sample_shuffle_indices` and hand-worked numbers."""

import numpy as np
import pytest

from megatron.core.datasets.gpt_indices import build_gpt_indices, get_num_epochs
from tests.unit_tests.datasets import cpp_reference

SIZES = np.array([5, 3, 4, 6, 2], dtype=np.int32)  # 20 tokens per epoch
SEQ = 4  # (20 - 1) // 4 = 4 samples per epoch


def megatron_indices(sizes, documents, num_samples, seq_length, seed, extra=1, drop_last=True):
    """Megatron-LM's algorithm, written as it reads there (mgrid tiling, one RandomState)."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    if num_samples is not None:
        while num_tokens < num_samples * seq_length + extra:
            num_epochs += 1
            num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - extra) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    state = np.random.RandomState(seed)

    def document_index(epochs, separate_final):
        if not separate_final or epochs == 1:
            grid = np.mgrid[0:epochs, 0 : len(documents)][1]
            grid[:] = documents
            flat = grid.reshape(-1).astype(np.int32)
            state.shuffle(flat)
            return flat
        return np.concatenate((document_index(epochs - 1, False), document_index(1, False)))

    doc = document_index(num_epochs, separate)
    sample = cpp_reference.build_sample_idx(sizes, doc, seq_length, num_epochs, tokens_per_epoch, drop_last, extra, np.int32)
    total = sample.shape[0] - 1
    first = sans_final if separate else total
    shuffle_first = np.arange(first, dtype=np.uint32)
    state.shuffle(shuffle_first)
    shuffle = shuffle_first
    if first != total:
        shuffle_last = np.arange(first, total, dtype=np.uint32)
        state.shuffle(shuffle_last)
        shuffle = np.concatenate((shuffle_first, shuffle_last))
    return doc, sample, shuffle, num_epochs, separate


@pytest.mark.parametrize(
    "num_samples,epochs,separate",
    [
        (None, 1, False),  # one epoch
        (4, 1, False),  # 4 * 4 + 1 = 17 <= 20 tokens
        (7, 2, False),  # 3 samples from the final epoch, int(0.8 * 4) = 3: not fewer, so shuffled jointly
        (6, 2, True),  # 2 from the final epoch < 3: separate
        (10, 3, True),  # 41 tokens -> 3 epochs, 1 sample from the last
        (12, 3, False),
    ],
)
def test_indices_match_megatron(num_samples, epochs, separate):
    documents = np.arange(len(SIZES), dtype=np.int32)
    built = build_gpt_indices(SIZES, documents, num_samples, SEQ, 1234, True, True)
    doc, sample, shuffle, expected_epochs, expected_separate = megatron_indices(SIZES, documents, num_samples, SEQ, 1234)
    assert (built.num_epochs, built.separate_final_epoch) == (expected_epochs, expected_separate) == (epochs, separate)
    np.testing.assert_array_equal(built.document_index, doc)
    np.testing.assert_array_equal(built.sample_index, sample)
    np.testing.assert_array_equal(built.shuffle_index, shuffle)
    assert built.document_index.dtype == np.int32 and built.shuffle_index.dtype == np.uint32
    assert len(built.shuffle_index) >= (num_samples or 0)


def test_separated_final_epoch_stays_at_the_end():
    documents = np.arange(len(SIZES), dtype=np.int32)
    built = build_gpt_indices(SIZES, documents, 10, SEQ, 7, True, True)
    # 3 epochs of 5 documents; the last epoch is a permutation of its own.
    assert sorted(built.document_index[10:].tolist()) == documents.tolist()
    samples_before_final = (2 * 20 - 1) // SEQ
    assert sorted(built.shuffle_index[:samples_before_final].tolist()) == list(range(samples_before_final))
    assert sorted(built.shuffle_index[samples_before_final:].tolist()) == list(
        range(samples_before_final, len(built.shuffle_index))
    )


def test_split_subset_and_validation_padding_match_megatron():
    sizes = np.random.default_rng(3).integers(1, 30, 50).astype(np.int32)
    documents = np.arange(10, 35, dtype=np.int32)
    built = build_gpt_indices(sizes, documents, 40, 7, 99, True, False)
    doc, sample, shuffle, *_ = megatron_indices(sizes, documents, 40, 7, 99, drop_last=False)
    np.testing.assert_array_equal(built.document_index, doc)
    np.testing.assert_array_equal(built.sample_index, sample)
    np.testing.assert_array_equal(built.shuffle_index, shuffle)


@pytest.mark.parametrize("tokens_per_epoch,num_samples,seq,extra", [(20, 4, 4, 1), (20, 5, 4, 1), (7, 100, 3, 0), (1000, None, 8, 1)])
def test_num_epochs_is_the_smallest_that_covers_the_request(tokens_per_epoch, num_samples, seq, extra):
    epochs = get_num_epochs(tokens_per_epoch, num_samples, seq, extra)
    if num_samples is None:
        assert epochs == 1
        return
    assert epochs * tokens_per_epoch >= num_samples * seq + extra
    assert epochs == 1 or (epochs - 1) * tokens_per_epoch < num_samples * seq + extra


def test_empty_split_is_a_clear_error():
    with pytest.raises(ValueError, match="0 sequences"):
        build_gpt_indices(SIZES, np.zeros(0, dtype=np.int32), 10, SEQ, 1, True, True)
