"""Line-by-line transcriptions of Megatron-LM's masked-LM sample code (`masked_dataset.py`
`_create_masked_lm_predictions`, `bert_dataset.py` and `t5_dataset.py` `__getitem__`), kept in
Megatron-LM's own form (nested n-gram lists, `del` from list ends, `deque` of sentinels), as the
independent reference that our datasets must equal draw for draw. The permutation branch is left out
(Megatron-LM draws it from numpy's global random state).
"""

from collections import deque

import numpy


def create_masked_lm_predictions(token_ids, target_sequence_length, numpy_random_state, config, get_token_mask):
    tokenizer = config.tokenizer
    boundaries = []
    candidates = []
    for i, token_id in enumerate(token_ids):
        if token_id == tokenizer.cls or token_id == tokenizer.sep:
            boundaries.append(1)
        else:
            if not tokenizer.inv_vocab[token_id].startswith("##"):
                boundaries.append(1)
                candidates.append([i])
            else:
                boundaries.append(0)
                if config.masking_do_full_word and len(candidates) > 0:
                    candidates[-1].append(i)
                else:
                    candidates.append([i])

    n_maskings = min(
        config.masking_probability * target_sequence_length,
        max(1, int(round(len(token_ids) * config.masking_probability))),
    )
    ngram_nvals = numpy.arange(config.masking_max_ngram, dtype=numpy.int64) + 1
    nprobs = 1.0 / ngram_nvals
    nprobs = nprobs / nprobs.sum(keepdims=True)
    if config.masking_use_longer_ngrams:
        nprobs = nprobs[::-1]

    candidate_ngrams = [[candidates[idx : idx + n] for n in ngram_nvals] for idx in range(len(candidates))]
    numpy_random_state.shuffle(candidate_ngrams)

    masked_token_ids = list(token_ids)
    masked_positions_and_labels = []
    masked_spans = []
    masked_indices = set()
    for candidate_idx in range(len(candidate_ngrams)):
        n_ngrams = len(candidate_ngrams[candidate_idx])
        if len(masked_positions_and_labels) >= n_maskings:
            break
        if not candidate_ngrams[candidate_idx]:
            continue
        if config.masking_use_geometric_distribution:
            p = 0.2
            n = min(numpy_random_state.geometric(p), config.masking_max_ngram)
        else:
            p = nprobs[:n_ngrams] / nprobs[:n_ngrams].sum(keepdims=True)
            n = numpy_random_state.choice(ngram_nvals[:n_ngrams], p=p)
        while True:
            ngram_indices = sum(candidate_ngrams[candidate_idx][n - 1], [])
            n = n - 1
            if n_maskings >= len(masked_positions_and_labels) + len(ngram_indices):
                skip_candidate = False
                break
            if n == 0:
                skip_candidate = True
                break
        if skip_candidate:
            continue
        if any(map(lambda idx: idx in masked_indices, ngram_indices)):
            continue
        for index in ngram_indices:
            masked_indices.add(index)
            mask = get_token_mask(numpy_random_state)
            if mask is None:
                masked_token_ids[index] = token_ids[index]
            else:
                masked_token_ids[index] = mask
            masked_positions_and_labels.append((index, token_ids[index]))
        masked_spans.append((ngram_indices, [token_ids[index] for index in ngram_indices]))

    numpy_random_state.shuffle(candidate_ngrams)

    masked_positions_and_labels = sorted(masked_positions_and_labels, key=lambda x: x[0])
    masked_positions = []
    masked_labels = []
    for position, label in masked_positions_and_labels:
        masked_positions.append(position)
        masked_labels.append(label)
    masked_spans = sorted(masked_spans, key=lambda x: x[0][0])
    return masked_token_ids, masked_positions, masked_labels, boundaries, masked_spans


def bert_get_token_mask(numpy_random_state, tokenizer):
    token_lookup = list(tokenizer.inv_vocab.keys())
    if numpy_random_state.random() < 0.8:
        return tokenizer.mask
    else:
        if numpy_random_state.random() >= 0.5:
            return token_lookup[numpy_random_state.randint(0, len(token_lookup))]
    return None


def bert_getitem(dataset, sample_index, config, idx):
    tokenizer = config.tokenizer
    idx_beg, idx_end, target_sequence_length = sample_index[idx]
    sample = [dataset[i] for i in range(idx_beg, idx_end)]
    numpy_random_state = numpy.random.RandomState(seed=(config.random_seed + idx) % 2**32)

    pivot = len(sample)
    is_next_random = False
    if config.classification_head:
        assert len(sample) > 1
        pivot = 1
        if len(sample) >= 3:
            pivot = numpy_random_state.randint(low=1, high=len(sample))
        is_next_random = numpy_random_state.random() < 0.5
    split_A = []
    for sample_a in sample[:pivot]:
        split_A.extend(sample_a)
    split_B = []
    for sample_b in sample[pivot:]:
        split_B.extend(sample_b)
    if is_next_random:
        split_A, split_B = split_B, split_A

    length_A = len(split_A)
    length_B = len(split_B)
    if length_A + length_B <= target_sequence_length:
        truncated = False
    else:
        while length_A + length_B > target_sequence_length:
            split = split_A if length_A > length_B else split_B
            if numpy_random_state.random() < 0.5:
                del split[0]
            else:
                del split[-1]
            length_A = len(split_A)
            length_B = len(split_B)
        truncated = True

    tokens = [tokenizer.cls, *split_A, tokenizer.sep]
    assignments = [0 for _ in range(1 + len(split_A) + 1)]
    if split_B:
        tokens += [*split_B, tokenizer.sep]
        assignments += [1 for _ in range(len(split_B) + 1)]

    tokens, masked_positions, masked_labels, _, _ = create_masked_lm_predictions(
        tokens, target_sequence_length, numpy_random_state, config,
        lambda state: bert_get_token_mask(state, tokenizer),
    )

    length_toks = len(tokens)
    length_pads = config.sequence_length - length_toks
    tokens = numpy.array(tokens, dtype=numpy.int64)
    tokens = numpy.pad(tokens, (0, length_pads), constant_values=tokenizer.pad)
    assignments = numpy.array(assignments, dtype=numpy.int64)
    assignments = numpy.pad(assignments, (0, length_pads), constant_values=tokenizer.pad)
    mask_pads = numpy.ones(length_toks, dtype=numpy.int64)
    mask_pads = numpy.pad(mask_pads, (0, length_pads), constant_values=tokenizer.pad)
    labels = numpy.zeros(config.sequence_length, dtype=numpy.int64) - 1
    labels[masked_positions] = masked_labels
    mask_loss = numpy.zeros(config.sequence_length, dtype=numpy.int64)
    mask_loss[masked_positions] = 1
    return {
        "text": tokens,
        "types": assignments,
        "labels": labels,
        "is_random": int(is_next_random),
        "padding_mask": mask_pads,
        "loss_mask": mask_loss,
        "truncated": int(truncated),
    }


def t5_getitem(dataset, sample_index, config, idx):
    tokenizer = config.tokenizer
    idx_beg, idx_end, target_sequence_length = sample_index[idx]
    sample = [dataset[i] for i in range(idx_beg, idx_end)]
    numpy_random_state = numpy.random.RandomState(seed=(config.random_seed + idx) % 2**32)

    tokens = [token for sentence in sample for token in sentence]
    truncated = len(tokens) > target_sequence_length
    tokens = tokens[:target_sequence_length]

    (tokens, _, _, _, masked_spans) = create_masked_lm_predictions(
        tokens, target_sequence_length, numpy_random_state, config, lambda state: tokenizer.mask
    )

    sentinels = deque(tokenizer.additional_special_tokens_ids)
    encoder_input = []
    decoder_input = [tokenizer.bos]
    decoder_output = []
    idx_beg = 0
    for indices, labels in masked_spans:
        sentinel = sentinels.popleft()
        idx_end = indices[0]
        encoder_input.extend(tokens[idx_beg:idx_end])
        encoder_input.append(sentinel)
        decoder_input.append(sentinel)
        decoder_input.extend(labels)
        decoder_output.append(sentinel)
        decoder_output.extend(labels)
        idx_beg = indices[-1] + 1
    encoder_input.extend(tokens[idx_beg:])
    decoder_output.append(tokenizer.eos)

    length_toks_encoder = len(encoder_input)
    length_toks_decoder = len(decoder_input)
    length_pads_encoder = config.sequence_length_encoder - length_toks_encoder
    length_pads_decoder = config.sequence_length_decoder - length_toks_decoder
    encoder_input = numpy.array(encoder_input, dtype=numpy.int64)
    encoder_input = numpy.pad(encoder_input, (0, length_pads_encoder), constant_values=tokenizer.pad)
    decoder_input = numpy.array(decoder_input, dtype=numpy.int64)
    decoder_input = numpy.pad(decoder_input, (0, length_pads_decoder), constant_values=tokenizer.pad)
    mask_encoder = numpy.array([1] * length_toks_encoder + [0] * length_pads_encoder)
    mask_decoder = numpy.array([1] * length_toks_decoder + [0] * length_pads_decoder)
    decoder_output = numpy.array(decoder_output, dtype=numpy.int64)
    decoder_output = numpy.pad(decoder_output, (0, length_pads_decoder), constant_values=-1)
    loss_mask = numpy.zeros(config.sequence_length_decoder, dtype=numpy.int64)
    loss_mask[:length_toks_decoder] = 1
    return {
        "text_enc": encoder_input,
        "text_dec": decoder_input,
        "labels": decoder_output,
        "loss_mask": loss_mask,
        "truncated": int(truncated),
        "enc_mask": mask_encoder,
        "dec_mask": mask_decoder,
    }
