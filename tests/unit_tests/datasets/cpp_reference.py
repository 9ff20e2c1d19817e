"""Line-by-line Python transcriptions of Megatron-LM's `megatron/core/datasets/helpers.cpp` loops.

They are slow (one Python iteration per sample) and serve only as the independent reference that the
vectorised `megatron.core.datasets.helpers` must match exactly. Asserts of the C++ are left out, as in
a build with NDEBUG.
"""

import math

import numpy as np


def build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch, drop_last_partial_sequence, add_extra_token, dtype):
    if drop_last_partial_sequence:
        num_samples = (num_epochs * tokens_per_epoch - add_extra_token) // seq_length
    else:
        # ceil(float(...) / seq_length): single-precision division in the C++.
        num_samples = math.ceil(np.float32(num_epochs * tokens_per_epoch - add_extra_token) / np.float32(seq_length))
    sample_idx = np.zeros((num_samples + 1, 2), dtype=dtype)
    sample_idx_index = 0
    document_idx_index = 0
    doc_offset = 0
    sample_idx[sample_idx_index] = (document_idx_index, doc_offset)
    sample_idx_index += 1
    while sample_idx_index <= num_samples:
        remaining_seq_length = seq_length + add_extra_token
        while remaining_seq_length != 0:
            document_index = document_idx[document_idx_index]
            document_length = int(sizes[document_index]) - doc_offset
            remaining_seq_length -= document_length
            if remaining_seq_length <= 0:
                doc_offset += remaining_seq_length + document_length - add_extra_token
                remaining_seq_length = 0
            else:
                if document_idx_index == len(document_idx) - 1:
                    doc_offset = int(sizes[document_idx[document_idx_index]]) - add_extra_token
                    break
                document_idx_index += 1
                doc_offset = 0
        sample_idx[sample_idx_index] = (document_idx_index, doc_offset)
        sample_idx_index += 1
    return sample_idx


def build_blending_indices(weights, size):
    weights = [float(weight) for weight in weights]
    current_samples = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - float(current_samples[0])
        for dataset_idx in range(1, len(weights)):
            error = weights[dataset_idx] * sample_idx_double - float(current_samples[dataset_idx])
            if error > max_error:
                max_error = error
                max_error_index = dataset_idx
        dataset_index[sample_idx] = max_error_index
        dataset_sample_index[sample_idx] = current_samples[max_error_index]
        current_samples[max_error_index] += 1
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes):
    sizes = [int(size) for size in sizes]
    total_size = sum(sizes)
    counts = [0] * len(sizes)
    unspent = set(range(len(sizes)))
    weights = [size / float(total_size) for size in sizes]
    dataset_index, dataset_sample_index = [], []
    index_sample = 0
    while unspent:
        index_sample_double = max(float(index_sample), 1.0)
        error_argmax, error_max = -1, -np.finfo(np.float64).max
        for index_dataset in sorted(unspent):
            error = weights[index_dataset] * index_sample_double - float(counts[index_dataset])
            if error > error_max:
                error_argmax, error_max = index_dataset, error
        dataset_index.append(error_argmax)
        dataset_sample_index.append(counts[error_argmax])
        counts[error_argmax] += 1
        if sizes[error_argmax] - counts[error_argmax] == 0:
            unspent.discard(error_argmax)
        index_sample += 1
    return np.array(dataset_index, dtype=np.int16), np.array(dataset_sample_index, dtype=np.int64)
