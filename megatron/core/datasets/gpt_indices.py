"""The three index arrays of a GPT dataset split, built exactly as Megatron-LM builds them.

* document index (int32): the split's sequence ids repeated for E epochs and shuffled;
* sample index ([S+1, 2]): where each sample starts in that document stream (`helpers.build_sample_idx`);
* shuffle index (uint32, int64 past 2**32-2 entries): a permutation of the S samples.

One `numpy.random.RandomState(seed)` draws, in order: the document-index shuffle(s), then the
shuffle-index shuffle(s); same seed and inputs, same arrays, bit for bit. When the last epoch is needed
only in small part (fewer than 80% of an epoch's samples), it is shuffled separately from the earlier
epochs, in both indices, so its few samples are not spread over the whole run.
"""

from dataclasses import dataclass

import numpy as np

from megatron.core.datasets.helpers import build_sample_idx

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTIndices:
    """The built arrays and the epoch bookkeeping that produced them."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    num_epochs: int
    separate_final_epoch: bool


def get_num_epochs(tokens_per_epoch: int, num_samples: int | None, sequence_length: int, extra_tokens: int) -> int:
    """Smallest E >= 1 with `E * tokens_per_epoch >= num_samples * sequence_length + extra_tokens`
    (1 when num_samples is None: one epoch)."""
    if num_samples is None:
        return 1
    tokens_needed = num_samples * sequence_length + extra_tokens
    return max(1, -(-tokens_needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, random_state: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` repeated `num_epochs` times (epoch-major), int32, shuffled in place; with
    `separate_final_epoch`, the first E-1 epochs and the last one are shuffled as two arrays."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, random_state, False)
        last = build_document_index(documents, 1, random_state, False)
        return np.concatenate((first, last))
    document_index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
    random_state.shuffle(document_index)
    return document_index


def build_shuffle_index(num_samples: int, total_size: int, random_state: np.random.RandomState) -> np.ndarray:
    """A shuffled `arange(total_size)`: `[0, num_samples)` and `[num_samples, total_size)` are shuffled
    separately (the second range is the separated final epoch, empty otherwise)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    indices: np.ndarray,
    num_samples: int | None,
    sequence_length: int,
    random_seed: int,
    add_extra_token_to_sequence: bool,
    drop_last_partial_sequence: bool,
) -> GPTIndices:
    """All three arrays for the split made of sequences `indices` of a dataset with `sequence_lengths`.

    Samples: S = (E * tokens_per_epoch - extra) // sequence_length (rounded up when the partial last
    sample is kept), at least `num_samples`. The final epoch is separate when E > 1 and
    `num_samples - samples_before_final < int(0.8 * samples_per_epoch)`, with
    `samples_before_final = ((E-1) * tpe - extra) // seq` and `samples_per_epoch = (tpe - extra) // seq`.
    """
    extra = int(add_extra_token_to_sequence)
    tokens_per_epoch = int(np.sum(sequence_lengths[indices], dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(
            f"the split has {len(indices)} sequences and {tokens_per_epoch} tokens: not enough for one sample; "
            f"give this split a larger share of --split or use more data"
        )
    num_epochs = get_num_epochs(tokens_per_epoch, num_samples, sequence_length, extra)

    separate_final_epoch = False
    samples_before_final = 0
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length
        samples_per_epoch = (tokens_per_epoch - extra) // sequence_length
        samples_from_final = num_samples - samples_before_final
        separate_final_epoch = samples_from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)

    random_state = np.random.RandomState(random_seed)
    document_index = build_document_index(indices, num_epochs, random_state, separate_final_epoch)
    sample_index = build_sample_idx(
        sequence_lengths,
        document_index,
        sequence_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        add_extra_token_to_sequence,
    )
    total_samples = sample_index.shape[0] - 1
    first_shuffled = samples_before_final if separate_final_epoch else total_samples
    shuffle_index = build_shuffle_index(first_shuffled, total_samples, random_state)
    return GPTIndices(document_index, sample_index, shuffle_index, num_epochs, separate_final_epoch)
