"""Pretraining samplers: data-parallel slicing and exact resumption from `consumed_samples`."""

import itertools

import pytest
import torch

from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def read(sampler_factory, consumed, data_parallel_size, steps):
    """Per step, every rank's micro-batch, with the samplers built at `consumed` samples."""
    iterators = [iter(sampler_factory(consumed, rank)) for rank in range(data_parallel_size)]
    return [[next(iterator) for iterator in iterators] for _ in range(steps)]


def test_single_sampler_slices_each_step_by_rank():
    samplers = [MegatronPretrainingSampler(20, 0, 2, rank, 3) for rank in range(3)]
    batches = [list(sampler) for sampler in samplers]
    # Steps of 6 indices: [0..5], [6..11], [12..17]; 18, 19 are dropped.
    assert batches[0] == [[0, 1], [6, 7], [12, 13]]
    assert batches[1] == [[2, 3], [8, 9], [14, 15]]
    assert batches[2] == [[4, 5], [10, 11], [16, 17]]
    assert list(MegatronPretrainingSampler(20, 0, 2, 0, 3, drop_last=False))[-1] == [18, 19]
    assert list(MegatronPretrainingSampler(20, 0, 2, 2, 3, drop_last=False))[-1] == []


@pytest.mark.parametrize("consumed", [8, 24, 40])  # multiples of micro_batch * dp, not of a global batch
def test_single_sampler_resumes_exactly(consumed):
    def factory(start, rank):
        return MegatronPretrainingSampler(100, start, 4, rank, 2)

    uninterrupted = read(factory, 0, 2, 12)
    skipped = consumed // 8
    assert read(factory, consumed, 2, 12 - skipped) == uninterrupted[skipped:]


@pytest.mark.parametrize("data_sharding", [True, False])
@pytest.mark.parametrize("consumed", [0, 16, 88, 104, 200])  # 96 samples per epoch: resume inside later epochs too
def test_cyclic_sampler_resumes_exactly(data_sharding, consumed):
    def factory(start, rank):
        return MegatronPretrainingRandomSampler(None, 100, start, 4, rank, 2, data_sharding)

    def epochs(sampler):  # iterating again continues with the next epoch
        return itertools.chain.from_iterable(iter(sampler) for _ in range(10))

    def run(start, steps):
        streams = [epochs(factory(start, rank)) for rank in range(2)]
        return [[next(stream) for stream in streams] for _ in range(steps)]

    uninterrupted = run(0, 40)
    skipped = consumed // 8
    assert run(consumed, 40 - skipped) == uninterrupted[skipped:]


def test_cyclic_sampler_epochs_are_permutations():
    samplers = [MegatronPretrainingRandomSampler(None, 100, 0, 4, rank, 2, True) for rank in range(2)]
    epoch = [index for sampler in samplers for batch in sampler for index in batch]
    assert sorted(epoch) == list(range(96))  # 100 - 100 % 8 samples, no repeats
    second = [index for batch in samplers[0] for index in batch]
    assert second != epoch[:48] and sorted(second) == list(range(48))  # rank 0's bucket, reshuffled


def test_cyclic_sampler_rejects_a_mid_step_resume():
    with pytest.raises(ValueError, match="whole number of steps"):
        next(iter(MegatronPretrainingRandomSampler(None, 100, 5, 4, 0, 2)))


@pytest.mark.parametrize(
    "arguments,message",
    [((0, 0, 2, 0, 1), "no sample"), ((10, 10, 2, 0, 1), "no samples left"), ((10, 0, 2, 2, 2), "data_parallel_rank")],
)
def test_single_sampler_argument_errors(arguments, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*arguments)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, idx):
        return {"value": torch.tensor(idx * idx)}


def test_data_loader():
    loader = build_pretraining_data_loader(Squares(), 8, 2, 1, 2, "single", num_workers=0)
    assert next(iter(loader))["value"].tolist() == [100, 121]  # step 2 (samples 8..11), rank 1's half
    assert build_pretraining_data_loader(Squares(), 0, 2, 0, 1, "external") is not None
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None
    with pytest.raises(ValueError, match="single, cyclic or external"):
        build_pretraining_data_loader(Squares(), 0, 2, 0, 1, "shuffled")
