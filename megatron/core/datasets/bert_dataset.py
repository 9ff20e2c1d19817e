"""The BERT dataset: `[CLS] A [SEP] B [SEP]` from a run of sentences, masked, with sentence order
prediction (Megatron-LM's `bert_dataset.py`).

With the binary head (`classification_head`, off with `--bert-no-binary-head`) a sample has at least two
sentences; they are cut at a random sentence boundary into A and B, and half of the samples swap A and
B, labelled `is_random = 1` (sentence order prediction, not next-sentence prediction from another
document). Without it, A is the whole run and there is no B. If A and B together exceed the sample's
target length, one token at a time is dropped from a random end of the longer segment. Then 15% of the
tokens are chosen for prediction (see `masked_dataset.py`); each becomes [MASK] with probability 0.8, a
random vocabulary id with probability 0.1, and stays as it was with probability 0.1.
"""

from dataclasses import dataclass

import numpy as np

from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig, padded

_SPECIAL_TOKENS = 3  # [CLS], [SEP], [SEP]


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of the BERT dataset."""

    classification_head: bool | None = None
    """Build two-segment samples for sentence order prediction (`--bert-binary-head`, the default)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.classification_head is None:
            problems.append("classification_head (--bert-binary-head / --bert-no-binary-head) is required")
        if self.sequence_length - _SPECIAL_TOKENS < 2:
            problems.append(
                f"sequence_length (--seq-length) must be at least {_SPECIAL_TOKENS + 2} (room for [CLS], two "
                f"[SEP] and two tokens), got {self.sequence_length}"
            )
        if problems:
            raise ValueError(f"{type(self).__name__} is not valid:\n  " + "\n  ".join(problems))


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """One split of a sentence-level dataset as BERT samples (see the module docstring).

    Each sample is a dict of numpy arrays of `sequence_length` int64 entries (the default collate makes
    them `[b, s]` tensors) and two ints:

    * `text`: token ids after masking, padded with the tokenizer's pad id;
    * `types`: 0 for [CLS], A and its [SEP], 1 for B and its [SEP], 0 on padding;
    * `labels`: the original id at each masked position, -1 elsewhere;
    * `is_random`: 1 if A and B were swapped, else 0;
    * `padding_mask`: 1 on tokens, 0 on padding;
    * `loss_mask`: 1 at the masked positions;
    * `truncated`: 1 if tokens were dropped to fit the target length.
    """

    special_tokens_per_sample = _SPECIAL_TOKENS

    def _min_sentences_per_sample(self) -> int:
        """Two with the binary head: sentence order prediction needs a boundary to swap at."""
        return 2 if self.config.classification_head else 1

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["classification_head"]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        sentences, target_length, random_state = self._sample_sentences(idx)
        tokenizer = self.config.tokenizer

        pivot, swapped = len(sentences), False
        if self.config.classification_head:
            pivot = 1 if len(sentences) < 3 else random_state.randint(low=1, high=len(sentences))
            swapped = random_state.random() < 0.5
        segment_a = [token for sentence in sentences[:pivot] for token in sentence]
        segment_b = [token for sentence in sentences[pivot:] for token in sentence]
        if swapped:
            segment_a, segment_b = segment_b, segment_a
        truncated = len(segment_a) + len(segment_b) > target_length
        segment_a, segment_b = _truncate_pair(segment_a, segment_b, target_length, random_state)

        tokens = [tokenizer.cls, *segment_a, tokenizer.sep]
        types = [0] * len(tokens)
        if segment_b:
            tokens += [*segment_b, tokenizer.sep]
            types += [1] * (len(segment_b) + 1)
        tokens, masked_positions, masked_labels, _, _ = self._create_masked_lm_predictions(
            tokens, target_length, random_state
        )

        sequence_length = self.config.sequence_length
        labels = np.full(sequence_length, -1, dtype=np.int64)
        labels[masked_positions] = masked_labels
        loss_mask = np.zeros(sequence_length, dtype=np.int64)
        loss_mask[masked_positions] = 1
        return {
            "text": padded(tokens, sequence_length, tokenizer.pad),
            "types": padded(types, sequence_length, 0),
            "labels": labels,
            "is_random": int(swapped),
            "padding_mask": padded([1] * len(tokens), sequence_length, 0),
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }

    def _get_token_mask(self, numpy_random_state: np.random.RandomState) -> int | None:
        """[MASK] 80% of the time, a random vocabulary id 10%, the token itself (None) 10%."""
        if numpy_random_state.random() < 0.8:
            return self.config.tokenizer.mask
        if numpy_random_state.random() >= 0.5:
            return self.token_lookup[numpy_random_state.randint(0, len(self.token_lookup))]
        return None


def _truncate_pair(
    segment_a: list[int], segment_b: list[int], target_length: int, random_state: np.random.RandomState
) -> tuple[list[int], list[int]]:
    """Drops tokens until `len(a) + len(b) <= target_length`: each step takes one token from the
    longer segment (B on ties), from its front or back with probability 1/2 (one draw per token)."""
    lengths = [len(segment_a), len(segment_b)]
    dropped = [[0, 0], [0, 0]]  # [front, back] of A and of B
    while lengths[0] + lengths[1] > target_length:
        segment = 0 if lengths[0] > lengths[1] else 1
        dropped[segment][0 if random_state.random() < 0.5 else 1] += 1
        lengths[segment] -= 1
    (a_front, a_back), (b_front, b_back) = dropped
    return segment_a[a_front : len(segment_a) - a_back], segment_b[b_front : len(segment_b) - b_back]
