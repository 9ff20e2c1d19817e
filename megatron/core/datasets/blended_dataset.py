"""`BlendedDataset`: samples drawn from several mid-level datasets in proportion to their weights.

Sample i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`, both arrays built by
Megatron's greedy rule (`helpers.build_blending_indices`): every prefix of the blend holds each dataset
as close to its weight as a whole number of samples allows. With `size=None` the blend is exhaustive:
dataset d gives exactly `weights[d]` samples (integer weights).
"""

import logging
from collections import OrderedDict

import numpy as np
import torch

from megatron.core.datasets.blend import normalize
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.blending_greedy import greedy_blend
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.megatron_dataset import MegatronDataset, describe, md5_hex
from megatron.core.datasets.rank_logging import global_rank, log_single_rank

logger = logging.getLogger(__name__)

_MAX_DATASETS = 32766  # the dataset index is int16


class BlendedDataset(torch.utils.data.Dataset):
    """Blend of `datasets` (all of one class and one split).

    Args:
        datasets: the mid-level datasets.
        weights: their relative weights (normalised here when `size` is given); with `size=None`, the
            exact number of samples to take from each (positive integers).
        size: the number of samples, or None for the exhaustive blend of `sum(weights)` samples.
        config: the dataset config (its `path_to_cache` enables caching of the blend indices).
    """

    def __init__(
        self,
        datasets: list[MegatronDataset],
        weights: list[float] | list[int],
        size: int | None,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        problems = []
        if not datasets or len(datasets) != len(weights):
            problems.append(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) > _MAX_DATASETS:
            problems.append(f"{len(datasets)} datasets, at most {_MAX_DATASETS} can be blended (int16 index)")
        if any(type(dataset) is not type(datasets[0]) for dataset in datasets):
            problems.append("all datasets must be of one class")
        if any(dataset.index_split != datasets[0].index_split for dataset in datasets):
            problems.append("all datasets must belong to one split")
        if not all(weight > 0 for weight in weights):
            problems.append(f"weights must be positive, got {list(weights)}")
        if size is None and any(int(weight) != weight for weight in weights):
            problems.append(f"an exhaustive blend (size=None) needs integer weights (counts), got {list(weights)}")
        if problems:
            raise ValueError("BlendedDataset is not valid: " + "; ".join(problems))
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")

        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = normalize(weights) if size is not None else list(weights)
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_description = describe(unique_identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)

        self.dataset_index, self.dataset_sample_index = self._build_indices()
        self._log_blend()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> dict:
        dataset_id = self.dataset_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][self.dataset_sample_index[idx]]}

    def dataset_sample_counts(self, num_samples: int) -> np.ndarray:
        """How many of the first `num_samples` blended samples come from each dataset (what a run that
        consumed `num_samples` in order has read from each)."""
        return np.bincount(self.dataset_index[:num_samples], minlength=len(self.datasets))

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray]:
        cache = None
        if self.config.path_to_cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            cache = IndexCache(self.config.path_to_cache, base, ["dataset_index", "dataset_sample_index"])
        if cache is not None and cache.exists():
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.split.name} indices")
            arrays = cache.load()
            return arrays["dataset_index"], arrays["dataset_sample_index"]
        if cache is not None and global_rank() != 0:
            raise FileNotFoundError(
                f"rank {global_rank()}: the {type(self).__name__} {self.split.name} indices are not in "
                f"{cache.directory}; global rank 0 builds them before a barrier, so every rank must see the "
                f"same cache directory (put --data-cache-path on a file system shared by all nodes)"
            )

        log_single_rank(logger, logging.INFO, f"Build the {type(self).__name__} {self.split.name} indices")
        if self.size is not None:
            dataset_index, dataset_sample_index = greedy_blend(np.array(self.weights), None, self.size)
        else:
            limits = np.array(self.weights, dtype=np.int64)
            total = int(limits.sum())
            dataset_index, dataset_sample_index = greedy_blend(limits.astype(np.float64) / float(total), limits, total)

        drawn = np.bincount(dataset_index, minlength=len(self.datasets))
        for number, (dataset, count) in enumerate(zip(self.datasets, drawn)):
            if count > len(dataset):
                raise IndexError(
                    f"The {self.split.name} blend oversamples the contributing datasets and, for example, "
                    f"requests {count} samples from {type(dataset).__name__} number {number} in excess of its "
                    f"size {len(dataset)}. Increase mid_level_dataset_surplus (--mid-level-dataset-surplus, "
                    f"now {self.config.mid_level_dataset_surplus}), e.g. two- or ten-fold."
                )
        if cache is not None:
            cache.save(
                {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}, self.unique_description
            )
        return dataset_index, dataset_sample_index

    def _log_blend(self) -> None:
        """Per dataset: its weight and how many samples the blend takes from it, of how many built."""
        drawn = self.dataset_sample_counts(len(self))
        total = max(len(self), 1)
        lines = [f"> {type(self).__name__} {self.split.name}: {len(self)} samples"]
        for dataset, weight, count in zip(self.datasets, self.weights, drawn):
            lines.append(
                f"    {dataset.dataset_path or 'mock data'}: weight {count / total:.4f} (given {weight}), "
                f"{count} samples = {count / max(len(dataset), 1):.1%} of the {len(dataset)} built"
            )
        log_single_rank(logger, logging.INFO, "\n".join(lines))
