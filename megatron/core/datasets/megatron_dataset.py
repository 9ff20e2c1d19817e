"""`MegatronDataset`: the mid-level dataset base class (one split of one low-level dataset).

It owns what every mid-level dataset shares: the `unique_identifiers` whose JSON description and md5
name the index cache files (byte-identical to Megatron-LM's, so caches are shared), and the pad id.
"""

import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.split import Split

logger = logging.getLogger(__name__)

LowLevelDataset = IndexedDataset | Iterable

_PAD_TOKEN_ID = -1  # never a real token id, so padding can be told apart from data


def describe(unique_identifiers: OrderedDict) -> str:
    """Megatron-LM's JSON description: nested objects (the tokenizer) contribute their own
    `unique_identifiers`."""

    def nested(value: Any):
        if isinstance(value, np.generic):  # e.g. a numpy integer passed as a size
            return value.item()
        try:
            return value.unique_identifiers
        except AttributeError:
            raise TypeError(
                f"{type(value).__name__} cannot be described for the index cache: it needs a "
                f"`unique_identifiers` dict (as Megatron tokenizers have)"
            ) from None

    return json.dumps(unique_identifiers, indent=4, default=nested)


def md5_hex(text: str) -> str:
    """md5 of the UTF-8 text, the cache-file name prefix."""
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def resolve_pad_token_id(tokenizer, allow_ambiguous: bool) -> int:
    """The tokenizer's pad id unless it is missing or collides with another special token.

    A pad id equal to eod/eos (or any other entry of `special_tokens_dict`) would mask real end-of-
    document tokens out of the loss, so it is replaced by -1 unless `allow_ambiguous` is set.
    """
    try:
        pad = tokenizer.pad
    except (AttributeError, NotImplementedError):
        return _PAD_TOKEN_ID
    if pad is None:
        return _PAD_TOKEN_ID
    try:
        special = [value for key, value in tokenizer.special_tokens_dict.items() if key != "pad_token"]
    except (AttributeError, NotImplementedError):
        special = []
    if not special:
        for name in ("eos", "eod"):
            try:
                special.append(getattr(tokenizer, name))
            except (AttributeError, NotImplementedError):
                pass
    if pad in special:
        if allow_ambiguous:
            logger.warning(f"pad id {pad} equals another special token id; tokens with that id are masked as padding")
            return int(pad)
        logger.warning(
            f"pad id {pad} equals another special token id (eod/eos); padding uses -1 instead so that real "
            f"special tokens stay in the loss (allow_ambiguous_pad_tokens keeps the tokenizer's id)"
        )
        return _PAD_TOKEN_ID
    return int(pad)


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split of a low-level dataset, as seen by the blend.

    Args:
        dataset: the low-level dataset (an `IndexedDataset`, or a mock).
        dataset_path: its path prefix, for bookkeeping and the cache description (None for mocks).
        indices: the low-level element ids of this split.
        num_samples: the minimum number of samples to build; None for one epoch.
        index_split: which split this is.
        config: the dataset config.
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attribute in self._key_config_attributes():
            self.unique_identifiers[attribute] = getattr(self.config, attribute)
        self.unique_description = describe(self.unique_identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)

        self._pad_token_id = resolve_pad_token_id(config.tokenizer, config.allow_ambiguous_pad_tokens)

    @staticmethod
    @abstractmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """How many elements the split ratios divide (sequences for GPT, documents for BERT/T5)."""

    @staticmethod
    @abstractmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        """Opens the low-level dataset at `dataset_path`."""

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """Config attributes that enter the cache description (and so the cache file names)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __getitem__(self, idx: int) -> dict:
        """One sample as a dict of tensors."""
