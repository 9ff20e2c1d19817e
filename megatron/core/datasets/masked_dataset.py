"""The masked-language-model datasets' shared parts (BERT and T5, Megatron-LM's `masked_dataset.py`).

Both read sentence-level data (`preprocess_data.py --split-sentences`: one sequence per sentence,
documents as runs of sentences), split a dataset by documents, and build a cached sample mapping of
sentence runs (`masked_sample_mapping.build_mapping`). Each sample is then masked with its own
`numpy.random.RandomState((seed + index) % 2**32)`, so sample i is the same in every run, on every rank
and in every data-loader worker; every draw below happens in Megatron-LM's order, so the samples equal
Megatron-LM's.

Masking (`_create_masked_lm_predictions`) works on words: a WordPiece token spelled `##...` continues
the word before it. From a random order of the word starts, it draws an n-gram length per start (P(n)
proportional to 1/n up to `masking_max_ngram`, or SpanBERT's geometric(0.2) clipped there) and masks the
n words from that start, falling back to shorter n-grams that fit the budget of
`min(p * target_length, max(1, round(len(tokens) * p)))` tokens, and skipping n-grams that overlap
masked ones. Each masked token becomes what the subclass's `_get_token_mask` says.
"""

import logging
import os
from abc import abstractmethod
from dataclasses import dataclass

import numpy as np

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_sample_mapping import build_mapping
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.rank_logging import global_rank, log_single_rank
from megatron.core.datasets.split import Split

logger = logging.getLogger(__name__)

_GEOMETRIC_P = 0.2  # SpanBERT's span-length distribution, https://arxiv.org/abs/1907.10529 section 3.1

_MASKING_FIELDS = (
    "masking_probability",
    "short_sequence_probability",
    "masking_max_ngram",
    "masking_do_full_word",
    "masking_do_permutation",
    "masking_use_longer_ngrams",
    "masking_use_geometric_distribution",
)


def missing_tokenizer_attributes(tokenizer, names: tuple[str, ...]) -> list[str]:
    """The attributes of `names` that `tokenizer` lacks (its properties raise for missing tokens)."""
    missing = []
    for name in names:
        try:
            if getattr(tokenizer, name) is None:
                missing.append(name)
        except (AttributeError, NotImplementedError):
            missing.append(name)
    return missing


def padded(values: list[int], length: int, pad: int) -> np.ndarray:
    """`values` followed by `pad` up to `length` entries (int64)."""
    array = np.full(length, pad, dtype=np.int64)
    array[: len(values)] = values
    return array


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of the masked WordPiece datasets (Megatron-LM's fields; all masking fields are
    required)."""

    masking_probability: float | None = None
    """The fraction of tokens to mask (`--mask-prob`, 0.15)."""

    short_sequence_probability: float | None = None
    """The probability of a sample with a random target length shorter than the maximum
    (`--short-seq-prob`, 0.1)."""

    masking_max_ngram: int | None = None
    """The longest n-gram (in words) masked at once (BERT 3, T5 10)."""

    masking_do_full_word: bool | None = None
    """Mask whole words: `##` continuation pieces go with the word they continue."""

    masking_do_permutation: bool | None = None
    """Also shuffle the tokens of further unmasked n-grams among themselves."""

    masking_use_longer_ngrams: bool | None = None
    """Reverse the n-gram length probabilities so that longer n-grams are likelier."""

    masking_use_geometric_distribution: bool | None = None
    """Draw n-gram lengths from SpanBERT's geometric distribution (p = 0.2), clipped at
    `masking_max_ngram`, instead of P(n) proportional to 1/n."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = [f"{name} is required" for name in _MASKING_FIELDS if getattr(self, name) is None]
        if self.tokenizer is None:
            problems.append("tokenizer is required (a WordPiece tokenizer with cls, sep, mask, pad and inv_vocab)")
        else:
            missing = missing_tokenizer_attributes(self.tokenizer, ("inv_vocab", "cls", "sep", "mask", "pad"))
            if missing:
                problems.append(
                    f"the tokenizer ({type(self.tokenizer).__name__}) lacks {', '.join(missing)}: masked datasets "
                    f"need a WordPiece tokenizer such as --tokenizer-type BertWordPieceLowerCase"
                )
        if not problems:
            if not 0.0 < self.masking_probability < 1.0:
                problems.append(f"masking_probability (--mask-prob) must be in (0, 1), got {self.masking_probability}")
            if not 0.0 <= self.short_sequence_probability <= 1.0:
                problems.append(
                    f"short_sequence_probability (--short-seq-prob) must be in [0, 1], got "
                    f"{self.short_sequence_probability}"
                )
            if self.masking_max_ngram < 1:
                problems.append(f"masking_max_ngram must be at least 1, got {self.masking_max_ngram}")
            if self.masking_use_geometric_distribution and self.masking_do_permutation:
                problems.append("masking_use_geometric_distribution and masking_do_permutation are exclusive")
        if not 0 < self.random_seed < 2**31 - 1:
            problems.append(f"random_seed (--seed) must be in [1, 2^31 - 2] for BERT/T5 data, got {self.random_seed}")
        if problems:
            raise ValueError(f"{type(self).__name__} is not valid:\n  " + "\n  ".join(problems))
        if self.masking_use_geometric_distribution and self.masking_use_longer_ngrams:
            log_single_rank(
                logger, logging.WARNING, "masking_use_geometric_distribution overrides masking_use_longer_ngrams"
            )


class MaskedWordPieceDataset(MegatronDataset):
    """Base of the BERT and T5 datasets: document splits, the cached sample mapping and masking.

    Args:
        indexed_dataset: the sentence-level low-level dataset.
        dataset_path: its path prefix.
        indexed_indices: the document ids of this split (contiguous).
        num_samples: the minimum number of samples; None for one epoch.
        index_split: which split this is.
        config: the dataset config.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        tokenizer = config.tokenizer
        self._cls, self._sep = tokenizer.cls, tokenizer.sep
        self._continuation_ids = {int(i) for i, token in tokenizer.inv_vocab.items() if token.startswith("##")}
        # P(n) for n = 1..max: proportional to 1/n, reversed for longer n-grams, normalised twice as in
        # Megatron-LM (once when built, once before each draw) so that the draws match to the last bit.
        self._ngram_lengths = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
        probabilities = 1.0 / self._ngram_lengths
        probabilities = probabilities / probabilities.sum(keepdims=True)
        if config.masking_use_longer_ngrams:
            probabilities = probabilities[::-1]
        self._ngram_probabilities = probabilities / probabilities.sum(keepdims=True)
        self.token_lookup = list(tokenizer.inv_vocab.keys())
        self.sample_index = self._build_sample_index(
            config.sequence_length - self.special_tokens_per_sample, self._min_sentences_per_sample()
        )

    special_tokens_per_sample: int
    """Positions a sample's special tokens take, left out of its target length."""

    def _min_sentences_per_sample(self) -> int:
        """Sentences a sample holds at least (documents with fewer are skipped)."""
        return 1

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """BERT and T5 split a dataset by document."""
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        """Opens `dataset_path.bin/.idx` (sentence level)."""
        if dataset_path is None:
            raise ValueError(
                "mock data (--mock-data) is not supported yet for the BERT and T5 datasets: give sentence-level "
                "data with --data-path (preprocess_data.py --split-sentences writes *_text_sentence.bin/.idx)"
            )
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MegatronDataset._key_config_attributes() + list(_MASKING_FIELDS)

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int) -> np.ndarray:
        """The sample mapping `[num_samples, 3]` (first sentence, last sentence + 1, target length),
        loaded from `{md5}-{Class}-sample_index.npy` or built and saved there.

        `sequence_length` is the longest target (the model's length less the special tokens). With
        torch.distributed initialised only global rank 0 builds on a cache miss; the builder makes
        the other ranks wait at a barrier, after which they load rank 0's file.
        """
        directory = self.config.path_to_cache or os.path.join(
            self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"
        )
        cache = IndexCache(directory, f"{self.unique_description_hash}-{type(self).__name__}", ["sample_index"])
        label = f"{type(self).__name__} {self.index_split.name} indices"
        if cache.exists():
            log_single_rank(logger, logging.INFO, f"Load the {label} from {cache.directory}")
            return cache.load()["sample_index"]
        if global_rank() != 0:
            raise FileNotFoundError(
                f"rank {global_rank()}: the {label} are not in {cache.directory}; global rank 0 builds them and "
                f"the other ranks load them after a barrier (BlendedMegatronDatasetBuilder does this), so every "
                f"rank must see the same cache directory (put --data-cache-path on a shared file system)"
            )
        log_single_rank(logger, logging.INFO, f"Build and save the {label}")
        indices = np.asarray(self.indices, dtype=np.int64)
        document_ids = np.append(indices, indices[-1] + 1) if len(indices) else np.zeros(1, dtype=np.int64)
        # With a sample count every needed epoch is walked (helpers.cpp takes int32 epochs).
        num_epochs = 1 if self.num_samples is None else np.iinfo(np.int32).max - 1
        try:
            sample_index = build_mapping(
                self.dataset.document_indices[document_ids],
                self.dataset.sequence_lengths,
                num_epochs,
                self.num_samples,
                sequence_length,
                self.config.short_sequence_probability,
                self.config.random_seed,
                False,
                min_sentences_per_sample,
            )
        except ValueError as error:
            where = f"{self.dataset_path} ({self.index_split.name}, {len(indices)} documents)"
            raise ValueError(f"{where}: {error}") from None
        cache.save({"sample_index": sample_index}, self.unique_description)
        log_single_rank(
            logger,
            logging.INFO,
            f"> {self.dataset_path} {self.index_split.name}: {len(sample_index)} samples ({self.num_samples} "
            f"requested) from {len(indices)} documents",
        )
        return sample_index

    def _sample_sentences(self, idx: int) -> tuple[list[list[int]], int, np.random.RandomState]:
        """The sentences (token-id lists) of sample `idx`, its target length, and its random state
        `RandomState((seed + idx) % 2**32)`, the source of every random choice made for the sample."""
        first, last, target_length = (int(value) for value in self.sample_index[idx])
        sentences = [self.dataset[sentence].tolist() for sentence in range(first, last)]
        return sentences, target_length, np.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)

    def _create_masked_lm_predictions(
        self, token_ids: list[int], target_sequence_length: int, numpy_random_state: np.random.RandomState
    ) -> tuple[list[int], list[int], list[int], list[int], list[tuple[list[int], list[int]]]]:
        """Masks `token_ids` (see the module docstring).

        Returns:
            the masked ids; the masked positions (ascending) and their original ids; the boundaries
            (1 where a word starts or at [CLS]/[SEP], 0 inside a word); the masked spans
            `(positions, original ids)` in order of position.
        """
        config = self.config
        # e.g. [CLS] a ##b ##c d ##e [SEP] -> boundaries 1 1 0 0 1 0 1, words [[1, 2, 3], [4, 5]]
        # (without whole-word masking every non-special token is a word of its own).
        boundaries, words = [], []
        for position, token_id in enumerate(token_ids):
            if token_id == self._cls or token_id == self._sep:
                boundaries.append(1)
            elif token_id not in self._continuation_ids:
                boundaries.append(1)
                words.append([position])
            else:
                boundaries.append(0)
                if config.masking_do_full_word and words:
                    words[-1].append(position)
                else:
                    words.append([position])

        budget = min(
            config.masking_probability * target_sequence_length,
            max(1, int(round(len(token_ids) * config.masking_probability))),
        )
        # Megatron-LM shuffles one entry per word start; only the permutation matters here.
        word_order = list(range(len(words)))
        numpy_random_state.shuffle(word_order)

        masked_ids = list(token_ids)
        masked = {}  # position -> original id
        spans = []
        for first_word in word_order:
            if len(masked) >= budget:
                break
            if config.masking_use_geometric_distribution:
                longest = min(numpy_random_state.geometric(_GEOMETRIC_P), config.masking_max_ngram)
            else:
                longest = numpy_random_state.choice(self._ngram_lengths, p=self._ngram_probabilities)
            positions = _longest_fitting_ngram(words, first_word, longest, len(masked), budget)
            if positions is None or any(position in masked for position in positions):
                continue
            for position in positions:
                masked[position] = token_ids[position]
                replacement = self._get_token_mask(numpy_random_state)
                if replacement is not None:
                    masked_ids[position] = replacement
            spans.append((positions, [token_ids[position] for position in positions]))

        if config.masking_do_permutation:
            self._permute_ngrams(masked_ids, masked, words, word_order, budget, numpy_random_state)

        masked_positions = sorted(masked)
        masked_labels = [masked[position] for position in masked_positions]
        spans.sort(key=lambda span: span[0][0])
        return masked_ids, masked_positions, masked_labels, boundaries, spans

    def _permute_ngrams(self, masked_ids, masked, words, word_order, budget, numpy_random_state) -> None:
        """Shuffles the tokens of further n-grams (none of them masked) among their positions, and adds
        those positions, with the ids they held before, to `masked`.

        Megatron-LM draws these n-gram lengths from numpy's global random state; here they come from
        the sample's state like every other draw, so samples stay reproducible.
        """
        numpy_random_state.shuffle(word_order)
        permuted = set()
        for first_word in word_order:
            if len(permuted) >= budget:
                break
            longest = numpy_random_state.choice(self._ngram_lengths, p=self._ngram_probabilities)
            positions = _longest_fitting_ngram(words, first_word, longest, len(permuted), budget)
            if positions is None or any(position in masked or position in permuted for position in positions):
                continue
            permuted.update(positions)
        targets = sorted(permuted)
        sources = list(targets)
        numpy_random_state.shuffle(sources)
        before = list(masked_ids)
        for target, source in zip(targets, sources):
            masked_ids[target] = before[source]
            masked[target] = before[target]

    @abstractmethod
    def _get_token_mask(self, numpy_random_state: np.random.RandomState) -> int | None:
        """The id that replaces a masked token, or None to keep the token."""


def _longest_fitting_ngram(
    words: list[list[int]], first_word: int, longest: int, used: int, budget: float
) -> list[int] | None:
    """Positions of the longest n-gram of at most `longest` words from `first_word` (cut short by the
    end of the sequence) whose tokens, added to the `used` ones, stay within `budget`; None if not even
    one word fits."""
    for length in range(longest, 0, -1):
        positions = [position for word in words[first_word : first_word + length] for position in word]
        if budget >= used + len(positions):
            return positions
    return None
