"""The index builders of Megatron-LM's `helpers.cpp`, in vectorised numpy (no compiler, same outputs).

`build_sample_idx` cuts the shuffled document stream of a GPT dataset into samples; it is closed form
(cumulative sums + `searchsorted`). The blending builders assign every sample of a `BlendedDataset` to a
contributing dataset with Megatron's sequential greedy rule; `blending_greedy.py` runs that rule for
many stretches of samples side by side. Both reproduce the C++ arrays bit for bit, dtypes included, so
that index caches written by Megatron-LM are interchangeable with ours.
"""

import logging
import math

import numpy as np

from megatron.core.datasets.blending_greedy import greedy_blend

logger = logging.getLogger(__name__)


def build_sample_idx(
    sizes: np.ndarray,
    document_indices: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
    dtype: np.dtype | None = None,
) -> np.ndarray:
    """Start of every sample in the document stream: `[num_samples + 1, 2]` rows `(i, offset)`.

    Row r says sample r starts at token `offset` of document `document_indices[i]`; sample r ends where
    row r+1 points, plus `add_extra_token_to_sequence` tokens, so consecutive samples share one token
    (the last input token's label is the next sample's first token).

    The stream is the documents `sizes[document_indices]` back to back, `num_epochs * tokens_per_epoch`
    tokens long. Sample r covers stream tokens `[r*seq, r*seq + seq + extra)`, so row r+1 is the
    document holding token `e - 1` with `e = (r+1)*seq + extra`, at offset `e - extra - start(doc)`:
    the first document whose cumulative end reaches `e`, which also skips zero-length documents exactly
    as the C++ walk does. When the stream runs out (only the ceil-rounded last sample with
    `drop_last_partial_sequence=False`) the row is `(last, sizes[last] - extra)`, as in helpers.cpp.

    `dtype` is int32 unless a document position or size exceeds it (Megatron's choice); pass int64 to
    force the wide variant (`build_sample_idx_int64`).
    """
    extra = int(add_extra_token_to_sequence)
    if sequence_length <= 1 or num_epochs <= 0 or tokens_per_epoch <= 1:
        raise ValueError(
            f"build_sample_idx needs sequence_length > 1, num_epochs > 0 and tokens_per_epoch > 1; got "
            f"{sequence_length}, {num_epochs}, {tokens_per_epoch}"
        )
    if dtype is None:
        largest = max(document_indices.shape[0], int(sizes.max()))
        dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64

    stream_tokens = num_epochs * tokens_per_epoch - extra
    if drop_last_partial_sequence:
        num_samples = stream_tokens // sequence_length
    else:
        # helpers.cpp rounds up in single precision: ceil(float(tokens) / seq_length).
        num_samples = math.ceil(np.float32(stream_tokens) / np.float32(sequence_length))

    document_lengths = sizes[document_indices].astype(np.int64)
    document_ends = np.cumsum(document_lengths)
    sample_ends = np.arange(1, num_samples + 1, dtype=np.int64) * sequence_length + extra
    positions = np.searchsorted(document_ends, sample_ends, side="left")
    ran_out = positions == len(document_lengths)
    positions[ran_out] = len(document_lengths) - 1
    offsets = sample_ends - extra - (document_ends[positions] - document_lengths[positions])
    offsets[ran_out] = document_lengths[-1] - extra

    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[0] = 0
    sample_index[1:, 0] = positions
    sample_index[1:, 1] = offsets
    return sample_index


def _check_outputs(dataset_index: np.ndarray, dataset_sample_index: np.ndarray, size: int) -> None:
    if dataset_index.dtype != np.int16 or dataset_sample_index.dtype != np.int64:
        raise ValueError(
            f"blending outputs must be int16 and int64 arrays (Megatron's dtypes), got "
            f"{dataset_index.dtype} and {dataset_sample_index.dtype}"
        )
    if dataset_index.shape[0] < size or dataset_sample_index.shape[0] < size:
        raise ValueError(
            f"blending outputs hold {dataset_index.shape[0]} and {dataset_sample_index.shape[0]} entries, "
            f"{size} are needed"
        )


def build_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights,
    num_datasets: int,
    size: int,
    verbose: bool,
) -> None:
    """Fills the first `size` entries: sample i comes from dataset `dataset_index[i]`, its
    `dataset_sample_index[i]`-th sample.

    Megatron's greedy rule: sample i goes to `argmax_d (weights[d] * max(i, 1) - count[d])`, the
    first dataset winning ties, where count[d] is how often d was chosen before i.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (num_datasets,):
        raise ValueError(f"{weights.shape[0]} weights given for {num_datasets} datasets")
    _check_outputs(dataset_index, dataset_sample_index, size)
    if verbose:
        logger.info("> building indices for blended datasets ...")
    chosen, sample = greedy_blend(weights, None, size)
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = sample
    if verbose:
        achieved = np.bincount(chosen, minlength=num_datasets) / max(size, 1)
        for index in range(num_datasets):
            logger.info(f"   dataset {index}, input: {weights[index]}, achieved: {achieved[index]}")


def build_exhaustive_blending_indices(
    dataset_index: np.ndarray, dataset_sample_index: np.ndarray, sizes, num_datasets: int
) -> None:
    """Fills `sum(sizes)` entries drawing exactly `sizes[d]` samples from dataset d.

    The same greedy rule with weights `sizes / sum(sizes)`, restricted to the datasets that still have
    samples left.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.shape != (num_datasets,):
        raise ValueError(f"{sizes.shape[0]} sizes given for {num_datasets} datasets")
    if (sizes <= 0).any():
        # helpers.cpp never retires a dataset of size 0 and writes past the end of its outputs.
        raise ValueError(f"every dataset of an exhaustive blend needs at least one sample, got sizes {sizes.tolist()}")
    total = int(sizes.sum())
    _check_outputs(dataset_index, dataset_sample_index, total)
    weights = sizes.astype(np.float64) / float(total)
    chosen, sample = greedy_blend(weights, sizes, total)
    dataset_index[:total] = chosen
    dataset_sample_index[:total] = sample
