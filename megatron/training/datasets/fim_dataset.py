"""Fill-in-the-middle GPT samples (`--fim-data`): Megatron-LM's `GPTFIMDataset`, the same transformation and the
same random draws, so that a run reads the same tokens as Megatron-LM's.

A sample of the GPT dataset (`sequence_length + 1` tokens) is cut at the FIM end-of-document token into
segments; each non-empty segment is rearranged, then followed by that token again (an empty segment, between
two such tokens or before the first, is dropped together with its end token), and the rest after the last one
is rearranged too, even when empty. Rearranging a sequence, with probability --fim-rate:

    text = ids_to_text(sequence, special tokens removed)     (nothing happens if it starts with --fim-no-prefix)
    two cut points drawn uniformly in 0 .. len(text), sorted: prefix | middle | suffix   (characters)
    SPM, with probability --fim-spm-rate:   <prefix> <suffix> suffix <middle> prefix middle
    PSM otherwise:                          <prefix> prefix <suffix> suffix <middle> middle

each part re-tokenized (`text_to_ids`); <prefix>, <middle>, <suffix> are the ids of --fim-prefix-token,
--fim-middle-token and --fim-suffix-token (`tokens_to_ids`: a token outside the vocabulary gives the unknown id,
for GPT-2 that of <|endoftext|>). With --fim-split-sample, a segment holding that token is instead rearranged
fragment by fragment (each with probability --fim-fragment-rate), the whole segment only with probability
--fim-rate. The result is cut or padded with --fim-pad-token's id back to the sample's length.

The draws come from one `numpy.random.RandomState(--seed)` per dataset, in the order samples are read (and, per
sample, segment by segment): a Bernoulli draw of the rate, the two cut points, a Bernoulli draw of the SPM rate.
"""

from dataclasses import dataclass

import numpy as np

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """The GPT dataset config with Megatron-LM's fill-in-the-middle fields."""

    fim_rate: float | None = None
    """Probability that a sequence (or, with `fim_split_sample`, a sample) is rearranged."""

    fim_spm_rate: float | None = None
    """Probability that a rearranged sequence is in suffix-prefix-middle order rather than prefix-suffix-middle."""

    fim_extra_tokens: dict | None = None
    """The sentinel tokens: {"prefix", "middle", "suffix", "pad", "eod"} -> token string."""

    fim_split_sample: str | None = None
    """A token at which samples are cut into fragments rearranged one by one."""

    fim_fragment_rate: float | None = None
    """Probability that a fragment is rearranged (with `fim_split_sample`)."""

    fim_no_prefix: str | None = None
    """Sequences whose text starts with this are left as they are."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = [f"{name} is required" for name in ("fim_rate", "fim_spm_rate", "fim_extra_tokens")
                    if getattr(self, name) is None]
        missing = {"prefix", "middle", "suffix", "pad", "eod"} - set(self.fim_extra_tokens or {})
        if self.fim_extra_tokens is not None and missing:
            problems.append(f"fim_extra_tokens lacks {sorted(missing)}")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            problems.append("fim_fragment_rate is required with fim_split_sample")
        if problems:
            raise ValueError(f"{type(self).__name__} is not valid:\n  " + "\n  ".join(problems))


class GPTFIMDataset(GPTDataset):
    """The GPT dataset with its samples rearranged for fill-in-the-middle training (module docstring)."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                 config: GPTFIMDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.np_rng = np.random.RandomState(seed=config.random_seed)
        tokenizer = config.tokenizer
        sentinels = config.fim_extra_tokens
        self.prefix_tok_id, self.middle_tok_id, self.suffix_tok_id, self.pad_tok_id, self.eod_tok_id = (
            tokenizer.tokens_to_ids([sentinels[name] for name in ("prefix", "middle", "suffix", "pad", "eod")]))
        self.fim_split_sample = None
        if config.fim_split_sample is not None:
            self.fim_split_sample = tokenizer.tokens_to_ids([config.fim_split_sample])[0]

    def _query_document_sample_shuffle_indices(self, idx: int) -> np.ndarray:
        sample = self._sample_tokens(idx)
        length = len(sample)
        pieces, start = [], 0
        for end in np.flatnonzero(sample == self.eod_tok_id):
            if end > start:
                pieces += [self._split_and_permute(sample[start:end]), [self.eod_tok_id]]
            start = end + 1
        pieces.append(self._split_and_permute(sample[start:]))
        permuted = np.concatenate(pieces).astype(np.int64)[:length]
        permuted = np.concatenate([permuted, np.full(length - len(permuted), self.pad_tok_id, dtype=np.int64)])
        return self._padded(permuted)

    def _split_and_permute(self, sequence: np.ndarray) -> np.ndarray:
        """`sequence` rearranged whole or, with --fim-split-sample, fragment by fragment."""
        breaks = np.flatnonzero(sequence == self.fim_split_sample) if self.fim_split_sample is not None else []
        if len(breaks) == 0:
            return self._permute(sequence, self.config.fim_rate)
        if not self.np_rng.binomial(1, self.config.fim_rate):
            return sequence
        pieces, start = [], 0
        for end in breaks:
            if end > start:
                pieces += [self._permute(sequence[start:end], self.config.fim_fragment_rate), [self.fim_split_sample]]
            start = end + 1
        pieces.append(self._permute(sequence[start:], self.config.fim_fragment_rate))
        return np.concatenate(pieces)

    def _permute(self, sequence: np.ndarray, rate: float) -> np.ndarray:
        """`sequence` in SPM or PSM order with probability `rate` (module docstring), else unchanged."""
        if not self.np_rng.binomial(1, rate):
            return sequence
        tokenizer = self.config.tokenizer
        text = tokenizer.ids_to_text(sequence, remove_special_tokens=True)
        if self.config.fim_no_prefix is not None and text.startswith(self.config.fim_no_prefix):
            return sequence
        low, high = sorted(self.np_rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.array(tokenizer.text_to_ids(part), dtype=np.int64)
                                  for part in (text[:low], text[low:high], text[high:]))
        if self.np_rng.binomial(1, self.config.fim_spm_rate):
            return np.concatenate([[self.prefix_tok_id, self.suffix_tok_id], suffix, [self.middle_tok_id], prefix,
                                   middle])
        return np.concatenate([[self.prefix_tok_id], prefix, [self.suffix_tok_id], suffix, [self.middle_tok_id],
                               middle])
