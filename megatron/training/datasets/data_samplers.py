"""Megatron's pretraining samplers and data loader: which sample indices each data-parallel rank reads.

Both samplers yield micro-batches of indices and start from `consumed_samples` (the number of samples
all data-parallel ranks together have read, as saved in checkpoints), so a resumed run reads exactly
what the uninterrupted run would have read next.

* `MegatronPretrainingSampler` ("single"): samples in order; each global step of
  `micro_batch_size * data_parallel_size` samples is cut into contiguous per-rank slices.
* `MegatronPretrainingRandomSampler` ("cyclic"): a fresh permutation each epoch, seeded by the epoch.
"""

import torch

from megatron.core.datasets.split import Split


class MegatronPretrainingSampler:
    """Indices `[consumed_samples, total_samples)` in order; rank r of a step of
    `micro_batch_size * data_parallel_size` indices gets `[r * mbs, (r + 1) * mbs)` of it.

    The last incomplete step is dropped unless `drop_last` is False (then each rank gets its slice of
    what is left, possibly empty).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        _check_arguments(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"no samples left to consume: consumed_samples={consumed_samples}, total_samples={total_samples}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self) -> tuple[int, int]:
        """This rank's slice of one step's indices."""
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self):
        start, end = self.get_start_end_idx()
        step = self.micro_batch_times_data_parallel_size
        first = self.consumed_samples
        while first + step <= self.total_samples:
            yield list(range(first + start, first + end))
            first += step
        if first < self.total_samples and not self.drop_last:
            yield list(range(min(first + start, self.total_samples), min(first + end, self.total_samples)))


class MegatronPretrainingRandomSampler:
    """Random order, epoch by epoch; the permutation of epoch e comes from `torch.Generator` seeded e.

    Each epoch covers `total_samples` minus the remainder that does not fill a step. With
    `data_sharding`, rank r owns a contiguous bucket of `total_samples // (mbs * dp) * mbs` indices
    and reads it in a random order; without it, all ranks share one permutation of the whole dataset,
    rank r taking every dp-th index. Iterating again continues with the next epoch.
    """

    def __init__(
        self,
        dataset,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ):
        _check_arguments(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"total_samples ({total_samples}) is smaller than one step of micro_batch_size * "
                f"data_parallel_size = {self.micro_batch_times_data_parallel_size} samples"
            )

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(
                f"consumed_samples ({self.consumed_samples}) must be a whole number of steps of "
                f"micro_batch_size * data_parallel_size = {self.micro_batch_times_data_parallel_size} "
                f"samples into its epoch of {active_total_samples}"
            )
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = torch.randperm(bucket_size, generator=generator).tolist()
            indices = [start + index for index in order[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            order = torch.randperm(full_bucket_size, generator=generator).tolist()
            indices = order[current_epoch_samples:][self.data_parallel_rank :: self.data_parallel_size]

        # The last incomplete micro-batch is dropped.
        for first in range(0, len(indices) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.micro_batch_times_data_parallel_size
            yield indices[first : first + self.micro_batch_size]


def _check_arguments(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size) -> None:
    problems = []
    if total_samples <= 0:
        problems.append(f"no sample to consume: total_samples={total_samples}")
    if micro_batch_size <= 0:
        problems.append(f"micro_batch_size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0:
        problems.append(f"data_parallel_size must be positive, got {data_parallel_size}")
    elif not 0 <= data_parallel_rank < data_parallel_size:
        problems.append(f"data_parallel_rank must be in [0, {data_parallel_size}), got {data_parallel_rank}")
    if problems:
        raise ValueError("sampler arguments are not valid: " + "; ".join(problems))


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    dataloader_type: str | None = "single",
    num_workers: int = 2,
    data_sharding: bool = True,
    full_validation: bool = False,
    worker_init_fn=None,
    pin_memory: bool | None = None,
):
    """A `torch.utils.data.DataLoader` over `dataset` that starts after `consumed_samples`.

    `dataloader_type`: "single" (in order; the default, also for None), "cyclic" (random epochs) or
    "external" (the dataset is already a loader and is returned as is). A validation dataset with
    `full_validation` is read in order from its start. Returns None for a None dataset.
    """
    if dataset is None:
        return None
    dataloader_type = dataloader_type or "single"
    split = getattr(dataset, "split", getattr(dataset, "index_split", None))
    if split == Split.valid and full_validation:
        batch_sampler = MegatronPretrainingSampler(
            len(dataset), 0, micro_batch_size, data_parallel_rank, data_parallel_size
        )
    elif dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset,
            len(dataset),
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            data_sharding,
        )
    elif dataloader_type == "external":
        return dataset
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported: use single, cyclic or external")
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    # The loader draws its workers' base seed from `generator` each time an iterator is made; without
    # one it would draw from the global torch RNG, which a resumed run has just restored from the
    # checkpoint, and dropout after a resume would differ from an uninterrupted run.
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        worker_init_fn=worker_init_fn if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(0),
    )
