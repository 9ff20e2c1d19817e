"""The GPT dataset: fixed-length samples cut from a shuffled stream of documents.

Sample i (of `len(dataset)`) is `sequence_length + 1` consecutive tokens of the document stream, found
through three cached index arrays (see `gpt_indices.py`): `shuffle_index[i]` picks a stream sample j,
`sample_index[j]` and `[j + 1]` give its first and last document positions and offsets, and
`document_index` maps positions to sequence ids of the low-level dataset. Consecutive stream samples
share one token, so every token is a label exactly once per epoch.
"""

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_indices import build_gpt_indices
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.rank_logging import global_rank, log_single_rank
from megatron.core.datasets.split import Split

logger = logging.getLogger(__name__)

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of the GPT datasets (Megatron-LM's fields and defaults)."""

    reset_position_ids: bool | None = None
    """Restart position ids at 0 after every end-of-document token (`--reset-position-ids`)."""

    reset_attention_mask: bool | None = None
    """Stop attention across end-of-document tokens (`--reset-attention-mask`)."""

    eod_mask_loss: bool | None = None
    """Exclude positions whose input token is end-of-document from the loss (`--eod-mask-loss`)."""

    create_attention_mask: bool = True
    """Return the `[1, s, s]` boolean mask (True = masked); off when the attention kernel builds it."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial validation sample instead of padding it."""

    add_extra_token_to_sequence: bool = True
    """Read `sequence_length + 1` tokens per sample so that tokens and labels both have
    `sequence_length` entries."""

    def __post_init__(self) -> None:
        super().__post_init__()
        flags = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
        problems = [f"{name} must be set to True or False" for name in flags if getattr(self, name) is None]
        if self.tokenizer is None:
            problems.append("tokenizer is required (an object with `eod` and `unique_identifiers`)")
        if problems:
            raise ValueError(f"{type(self).__name__} is not valid:\n  " + "\n  ".join(problems))


class GPTDataset(MegatronDataset):
    """One split of one `.bin/.idx` dataset as GPT samples (see the module docstring).

    Args:
        indexed_dataset: the low-level dataset.
        dataset_path: its path prefix (enters the cache description).
        indexed_indices: the sequence ids of this split.
        num_samples: the minimum number of samples; None for exactly one epoch.
        index_split: which split this is.
        config: the GPT dataset config.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str | None,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self._cached_masks_and_position_ids = None
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits a dataset by sequence (BERT and T5 split by document)."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Opens `dataset_path.bin/.idx`."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """`tokens`, `labels` (int64 [s]), `loss_mask` (float32 [s]), `position_ids` (int64 [s]) and,
        with `create_attention_mask`, `attention_mask` (bool [1, s, s], True = masked).

        `idx=None` gives a padding sample whose loss mask is all zeros.
        """
        text = torch.from_numpy(self._query_document_sample_shuffle_indices(0 if idx is None else idx))
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if self._cached_masks_and_position_ids is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks_and_position_ids
            loss_mask = loss_mask.clone()  # masked in place below
        else:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self._cached_masks_and_position_ids = (attention_mask, loss_mask.clone(), position_ids)

        loss_mask[labels == self._pad_token_id] = 0.0
        # Pad ids (possibly -1) must still index the embedding table.
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> np.ndarray:
        """The `sequence_length + extra` token ids (int64) of sample `idx`, padded if the stream ran out."""
        return self._padded(self._sample_tokens(idx))

    def _padded(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens` padded with the pad id to `sequence_length + extra` (where the document stream ran out)."""
        missing = self.config.sequence_length + int(self.config.add_extra_token_to_sequence) - len(tokens)
        if missing > 0:
            tokens = np.concatenate([tokens, np.full(missing, self._pad_token_id, dtype=np.int64)])
        return tokens.astype(np.int64, copy=False)

    def _sample_tokens(self, idx: int) -> np.ndarray:
        """The token ids of sample `idx` as the documents hold them: `sequence_length + extra` unless the stream
        ran out."""
        extra = int(self.config.add_extra_token_to_sequence)
        stream_sample = int(self.shuffle_index[idx])
        first_position, first_offset = (int(value) for value in self.sample_index[stream_sample])
        last_position, last_offset = (int(value) for value in self.sample_index[stream_sample + 1])
        document = self.document_index

        if first_position == last_position:
            length = last_offset - first_offset + extra
            parts = [self.dataset.get(int(document[first_position]), offset=first_offset, length=length)]
        else:
            parts = [self.dataset.get(int(document[first_position]), offset=first_offset)]
            for position in range(first_position + 1, last_position):
                parts.append(self.dataset.get(int(document[position])))
            parts.append(self.dataset.get(int(document[last_position]), offset=0, length=last_offset + extra))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def _cache(self) -> IndexCache | None:
        directory = self.config.path_to_cache
        if directory is None and not self.config.mock:
            # Megatron-LM's default: a directory named after the prefix, next to prefix.bin.
            directory = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        if directory is None:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        return IndexCache(directory, base, list(_INDEX_NAMES))

    def _build_document_sample_shuffle_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Loads the three index arrays from the cache, or builds (and caches) them.

        With torch.distributed initialised only global rank 0 builds on a cache miss; the builder
        makes the other ranks wait at a barrier, after which they load rank 0's files.
        """
        cache = self._cache()
        label = f"{type(self).__name__} {self.index_split.name} indices"
        if cache is not None and cache.exists():
            log_single_rank(logger, logging.INFO, f"Load the {label} from {cache.directory}")
            arrays = cache.load()
            indices = tuple(arrays[name] for name in _INDEX_NAMES)
        elif cache is None or global_rank() == 0:
            log_single_rank(logger, logging.INFO, f"Build and save the {label}")
            drop_last = self.index_split != Split.valid or self.config.drop_last_partial_validation_sequence
            try:
                built = build_gpt_indices(
                    self.dataset.sequence_lengths,
                    self.indices,
                    self.num_samples,
                    self.config.sequence_length,
                    self.config.random_seed,
                    self.config.add_extra_token_to_sequence,
                    drop_last,
                )
            except ValueError as error:
                raise ValueError(f"{self.dataset_path or 'mock data'} ({self.index_split.name}): {error}") from None
            indices = built.document_index, built.sample_index, built.shuffle_index
            if cache is not None:
                cache.save(dict(zip(_INDEX_NAMES, indices)), self.unique_description)
        else:
            raise FileNotFoundError(
                f"rank {global_rank()}: the {label} are not in {cache.directory}; global rank 0 builds them "
                f"and the other ranks load them after a barrier (BlendedMegatronDatasetBuilder does this), "
                f"so every rank must see the same cache directory (put --data-cache-path on a file system "
                f"shared by all nodes)"
            )
        num_epochs = len(indices[0]) // max(len(self.indices), 1)
        log_single_rank(
            logger,
            logging.INFO,
            f"> {self.dataset_path or 'mock data'} {self.index_split.name}: {indices[1].shape[0] - 1} samples "
            f"({self.num_samples} requested) from {num_epochs} epoch(s) of {len(self.indices)} sequences",
        )
        return indices


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Attention mask, loss mask and position ids of one left-to-right sample `data` [s].

    attention_mask [1, s, s] bool, True = masked: causal, and with `reset_attention_mask` a query after
    an EOD at position i cannot see keys <= i (query q sees key k iff k <= q and no EOD lies in
    [k, q)); None without `create_attention_mask`.
    loss_mask [s] float32: 1, or 0 where the input token is EOD with `eod_mask_loss`.
    position_ids [s] int64: `arange(s)`, restarting at 0 after each EOD with `reset_position_ids`.
    """
    seq_length = data.numel()
    positions = torch.arange(seq_length, dtype=torch.long, device=data.device)
    is_eod = data == eod_token

    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    position_ids = positions
    if reset_position_ids:
        # Start of each position's document: one past the last EOD strictly before it.
        last_eod = torch.cummax(torch.where(is_eod, positions, -1), dim=0).values  # [s], EOD at or before p
        document_start = torch.cat([positions.new_zeros(1), last_eod[:-1] + 1])
        position_ids = positions - document_start

    attention_mask = None
    if create_attention_mask:
        visible = torch.tril(torch.ones((seq_length, seq_length), dtype=torch.bool, device=data.device))
        if reset_attention_mask:
            document = torch.cumsum(is_eod, dim=0) - is_eod.long()  # [s], EODs strictly before p
            visible &= document[:, None] == document[None, :]
        attention_mask = (~visible).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Synthetic documents for `--mock-data`: 100,000 documents with lengths drawn by
    `numpy.random.default_rng(0).integers(1, 4096)`; document k of length L is
    `[1, 2, ..., L-1] % vocab_size` followed by EOD."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer) -> None:
        try:
            self.vocab_size = int(tokenizer.vocab_size)
            self.eod_token = int(tokenizer.eod)
        except (AttributeError, NotImplementedError, TypeError) as error:
            raise ValueError(f"mock data needs a tokenizer with `vocab_size` and `eod`: {error}") from None
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        return np.concatenate([(np.arange(1, length, dtype=np.int64)) % self.vocab_size, [self.eod_token]])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `idx` (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """`GPTDataset` over `MockGPTLowLevelDataset`: the same index logic, no files (cached only when
    `path_to_cache` is set)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a mock config: give neither blend nor blend_per_split")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
