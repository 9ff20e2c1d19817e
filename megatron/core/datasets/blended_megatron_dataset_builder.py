"""`BlendedMegatronDatasetBuilder`: the train/valid/test datasets of a config, from its blend(s).

For each split:
* one prefix without weight: the mid-level dataset itself (e.g. a `GPTDataset`);
* weighted prefixes: a `BlendedDataset` of `sum(ceil(size * w))` samples over mid-level datasets of
  `ceil(ceil(size * w) * (1 + surplus))` samples each (the surplus keeps the greedy blend from running
  past a dataset's end);
* unweighted prefixes: one epoch of each mid-level dataset, blended in proportion to their lengths,
  `min(size, total)` samples (all of them, exhaustively, when size is None).

With torch.distributed initialised, global rank 0 builds (and caches) first, every rank meets at a
barrier, then the other ranks build, which loads rank 0's cache files. Only ranks where
`is_built_on_rank()` is true get datasets; the others get None.
"""

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from megatron.core.datasets.blend import normalize
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.rank_logging import log_single_rank
from megatron.core.datasets.split import Split, split_ranges

logger = logging.getLogger(__name__)

SplitMatrix = list[tuple[float, float] | None]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class BlendedMegatronDatasetBuilder:
    """Builds `[train, valid, test]` (each a dataset or None) for `config`.

    Args:
        cls: the mid-level dataset class, e.g. `GPTDataset` or `MockGPTDataset`.
        sizes: the minimum number of samples per split; None means one epoch (or the whole blend).
        is_built_on_rank: True on the ranks that need the datasets; must be True on global rank 0.
        config: the dataset config.
    """

    def __init__(
        self,
        cls: type[MegatronDataset],
        sizes: list[int | None],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ):
        if len(sizes) != len(Split):
            raise ValueError(f"sizes needs {len(Split)} entries (train, valid, test), got {sizes}")
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        log_single_rank(logger, logging.INFO, f"Building {cls.__name__} splits with sizes={sizes}")
        for split, blend in zip(Split, self._blend_of_each_split()):
            if blend is not None and blend[1] is not None and sizes[split.value] is None:
                raise ValueError(
                    f"the {split.name} blend has weights, so it needs a number of samples, but its size is None; "
                    f"weights are sampling rates over a requested size (drop the weights for one epoch of each)"
                )

    def _blend_of_each_split(self) -> list:
        if self.config.mock:
            return [None] * len(Split)
        if self.config.blend_per_split is not None and any(self.config.blend_per_split):
            return list(self.config.blend_per_split)
        return [self.config.blend if bounds is not None else None for bounds in self.config.split_matrix]

    def build(self) -> list[MegatronDataset | BlendedDataset | None]:
        """The datasets of each split, in `Split` order. Must be called on every rank."""
        config = self.config
        if config.mock:
            return self._build_megatron_dataset_splits(None, config.split_matrix, self.sizes)
        if not (config.blend_per_split is not None and any(config.blend_per_split)):
            prefixes, weights = config.blend
            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], config.split_matrix, self.sizes)
            return self._build_blends(prefixes, weights, config.split_matrix, self.sizes)

        datasets = [None] * len(Split)
        for index, blend in enumerate(config.blend_per_split):
            if blend is None:
                continue
            # The whole of each dataset goes to this split.
            split_matrix = [None] * len(Split)
            split_matrix[index] = (0.0, 1.0)
            sizes = [0] * len(Split)
            sizes[index] = self.sizes[index]
            prefixes, weights = blend
            if len(prefixes) == 1:
                datasets[index] = self._build_megatron_dataset_splits(prefixes[0], split_matrix, sizes)[index]
            else:
                datasets[index] = self._build_blends(prefixes, weights, split_matrix, sizes)[index]
        return datasets

    def _build_blends(
        self, prefixes: list[str], weights: list[float] | None, split_matrix: SplitMatrix, sizes: list[int | None]
    ) -> list[BlendedDataset | None]:
        """A `BlendedDataset` per split of `split_matrix` over the datasets of `prefixes`."""
        if weights is None:
            mid_level_sizes = [[None] * len(Split) for _ in prefixes]  # one epoch each
        else:
            weights = normalize(weights)
            target_sizes = _get_size_per_split_per_dataset(weights, sizes)
            mid_level_sizes = _get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        mid_level = self._build_megatron_datasets_parallel(prefixes, split_matrix, mid_level_sizes)

        blended = [None] * len(Split)
        for index in range(len(Split)):
            if split_matrix[index] is None:
                continue
            datasets = mid_level[index]
            if weights is not None:
                blend_weights, size = weights, sum(target[index] for target in target_sizes)
            elif all(dataset is not None for dataset in datasets):
                blend_weights = [len(dataset) for dataset in datasets]
                size = None if sizes[index] is None else min(sizes[index], sum(blend_weights))
            else:  # not built on this rank; build_generic_dataset returns None without using them
                blend_weights, size = None, None
            blended[index] = self.build_generic_dataset(
                BlendedDataset, self.is_built_on_rank, True, datasets, blend_weights, size, self.config
            )
        return blended

    def _build_megatron_datasets_parallel(
        self, prefixes: list[str], split_matrix: SplitMatrix, sizes_per_dataset: list[list[int | None]]
    ) -> list[list[MegatronDataset | None]]:
        """`[split][prefix]` mid-level datasets, built by `num_dataset_builder_threads` threads."""
        datasets = [[] for _ in Split]

        def build_all() -> None:
            with ThreadPoolExecutor(max_workers=self.config.num_dataset_builder_threads) as executor:
                futures = [
                    executor.submit(self._build_megatron_dataset_splits, prefix, split_matrix, sizes, False)
                    for prefix, sizes in zip(prefixes, sizes_per_dataset)
                ]
                for future in futures:
                    for index, dataset in enumerate(future.result()):
                        datasets[index].append(dataset)

        if _distributed():
            rank = torch.distributed.get_rank()
            if rank == 0:
                build_all()
            torch.distributed.barrier()
            if rank != 0:
                build_all()
        else:
            build_all()
        return datasets

    def _build_megatron_dataset_splits(
        self,
        dataset_path: str | None,
        split_matrix: SplitMatrix,
        sizes: list[int | None],
        synchronize_ranks: bool = True,
    ) -> list[MegatronDataset | None]:
        """The mid-level dataset of each split of one low-level dataset.

        Split i gets the low-level elements `[round(begin * N), round(end * N))`.
        """
        if _distributed() and not self.is_built_on_rank():
            if synchronize_ranks:
                for bounds in split_matrix:
                    if bounds is not None:
                        torch.distributed.barrier()  # matches the barrier of each split built below
            return [None] * len(Split)

        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets = []
        for split, elements in zip(Split, split_ranges(split_matrix, num_elements)):
            if elements is None:
                datasets.append(None)
                continue
            begin, end = elements
            indices = np.arange(start=begin, stop=end, step=1, dtype=np.int32)
            datasets.append(
                self.build_generic_dataset(
                    self.cls,
                    self.is_built_on_rank,
                    synchronize_ranks,
                    low_level_dataset,
                    dataset_path,
                    indices,
                    sizes[split.value],
                    split,
                    self.config,
                )
            )
        return datasets

    @staticmethod
    def build_generic_dataset(
        cls: Callable, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool, *args: Any
    ) -> Any:
        """`cls(*args)`: on global rank 0 first, then (after a barrier when `synchronize_ranks`) on the
        other ranks where `is_built_on_rank()`; None elsewhere."""
        if not _distributed():
            return cls(*args)
        rank = torch.distributed.get_rank()
        dataset = None
        if rank == 0 and is_built_on_rank():
            dataset = cls(*args)
        if synchronize_ranks:
            torch.distributed.barrier()
        if rank != 0 and is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _get_size_per_split_per_dataset(
    normalized_weights: list[float], target_size_per_split: list[int | None], surplus: float = 0.0
) -> list[list[int | None]]:
    """`[dataset][split]` sample counts: `ceil(ceil(size * weight) * (1 + surplus))`."""
    def samples(size: int | None, weight: float) -> int | None:
        return None if size is None else int(math.ceil(math.ceil(size * weight) * (1 + surplus)))

    return [[samples(size, weight) for size in target_size_per_split] for weight in normalized_weights]
