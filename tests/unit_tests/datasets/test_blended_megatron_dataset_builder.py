"""Split strings, blends and the builder, against Megatron-LM's `parse_and_normalize_split`,
`get_blend_from_list` and `BlendedMegatronDatasetBuilder`."""

import math
import os

import numpy as np
import pytest

from megatron.core.datasets.blend import get_blend_from_list
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.split import Split, convert_split_vector_to_split_matrix, parse_and_normalize_split
from tests.unit_tests.datasets.gpt_fixtures import gpt_config, random_documents, write_dataset
from tests.unit_tests.dist_utils import run_distributed


@pytest.mark.parametrize(
    "split,expected",
    [
        ("969,30,1", [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]),
        ("969, 30, 1", [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]),
        ("99,1,0", [(0, 0.99), (0.99, 1.0), None]),
        ("98/2/0", [(0, 0.98), (0.98, 1.0), None]),
        ("1", [(0, 1.0), None, None]),
    ],
)
def test_split_matrix(split, expected):
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    assert len(matrix) == 3
    for bounds, want in zip(matrix, expected):
        assert (bounds is None and want is None) or np.allclose(bounds, want)


@pytest.mark.parametrize("split", ["", "1,2,3,4", "0,0,0"])
def test_bad_split_strings(split):
    with pytest.raises(ValueError, match="'969,30,1'"):
        parse_and_normalize_split(split)


def test_get_blend_from_list():
    assert get_blend_from_list(None) is None
    assert get_blend_from_list(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["a", "b", "c"]) == (["a", "b", "c"], None)
    with pytest.raises(ValueError, match="positive"):
        get_blend_from_list(["0", "a", "1", "b"])


def test_config_errors_are_collected():
    with pytest.raises(ValueError) as error:
        gpt_config(blend=(["a"], None), blend_per_split=[(["b"], None), None, None], reset_position_ids=None)
    message = str(error.value)
    assert "exclusive" in message
    with pytest.raises(ValueError, match="split .* is required"):
        gpt_config(blend=(["a"], None))
    with pytest.raises(ValueError, match="reset_attention_mask must be set"):
        gpt_config(reset_attention_mask=None)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpora")
    return [write_dataset(str(directory / name), random_documents(1000, seed)) for seed, name in enumerate("abc")]


def test_split_ranges_are_over_sequences(corpora, tmp_path):
    config = gpt_config(blend=([corpora[0]], None), split="969,30,1", path_to_cache=str(tmp_path))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 1], lambda: True, config).build()
    assert (train.indices[0], train.indices[-1] + 1) == (0, 969)
    assert (valid.indices[0], valid.indices[-1] + 1) == (969, 999)
    assert test.indices.tolist() == [999]


def test_weighted_blend_sizes(corpora, tmp_path):
    config = gpt_config(blend=(corpora[:2], [30.0, 70.0]), split="99,1,0", path_to_cache=str(tmp_path))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [1000, 50, 7], lambda: True, config).build()
    assert test is None
    assert isinstance(train, BlendedDataset)
    for blended, size in ((train, 1000), (valid, 50)):
        targets = [math.ceil(size * weight) for weight in (0.3, 0.7)]
        assert len(blended) == sum(targets)
        for dataset, target in zip(blended.datasets, targets):
            assert dataset.num_samples == math.ceil(target * 1.005)
        assert blended.dataset_sample_counts(len(blended)).tolist() == targets
    sample = train[11]
    dataset_id = int(train.dataset_index[11])
    assert sample["dataset_id"] == dataset_id
    expected = train.datasets[dataset_id][int(train.dataset_sample_index[11])]
    assert sample["tokens"].tolist() == expected["tokens"].tolist()
    assert any(name.endswith("BlendedDataset-train-dataset_index.npy") for name in os.listdir(tmp_path))


def test_unweighted_blend_uses_dataset_lengths(corpora, tmp_path):
    config = gpt_config(blend=(corpora[:2], None), split="90,10,0", path_to_cache=str(tmp_path))
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [300, None, None], lambda: True, config).build()
    lengths = [len(dataset) for dataset in train.datasets]
    assert all(dataset.num_samples is None for dataset in train.datasets)
    assert len(train) == min(300, sum(lengths))
    _, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [300, None, None], lambda: True, config).build()
    assert len(valid) == sum(len(dataset) for dataset in valid.datasets)  # exhaustive
    assert valid.dataset_sample_counts(len(valid)).tolist() == [len(dataset) for dataset in valid.datasets]


def test_blend_per_split(corpora, tmp_path):
    config = gpt_config(
        blend_per_split=[([corpora[0]], None), (corpora[1:], [1.0, 3.0]), None], path_to_cache=str(tmp_path)
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [64, 40, None], lambda: True, config).build()
    assert isinstance(train, GPTDataset) and train.indices.tolist() == list(range(1000))
    assert isinstance(valid, BlendedDataset) and len(valid) == 10 + 30 and test is None
    with pytest.raises(ValueError, match="needs a number of samples"):
        BlendedMegatronDatasetBuilder(GPTDataset, [64, None, None], lambda: True, config)


def test_mock_builder():
    config = gpt_config(sequence_length=4096)  # 33,333 mock documents per split, ~2048 tokens each
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [20, 10, 5], lambda: True, config).build()
    assert [len(dataset) >= size for dataset, size in ((train, 20), (valid, 10), (test, 5))] == [True] * 3
    assert train.indices[0] == 0 and valid.indices[0] == 33333


class CountingDataset(MegatronDataset):
    """A mid-level dataset of `length` samples {"value": i}."""

    def __init__(self, length, config):
        super().__init__(None, f"counting-{length}", np.arange(length), length, Split.train, config)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        return {"value": int(idx)}

    @staticmethod
    def numel_low_level_dataset(low_level_dataset):
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        raise AssertionError("CountingDataset has no low-level dataset")


def test_oversampled_blend_names_the_surplus():
    config = gpt_config()
    with pytest.raises(IndexError, match="mid_level_dataset_surplus"):
        BlendedDataset([CountingDataset(3, config), CountingDataset(10, config)], [0.5, 0.5], 10, config)
    blend = BlendedDataset([CountingDataset(5, config), CountingDataset(10, config)], [0.5, 0.5], 10, config)
    assert sorted(blend[i]["value"] for i in range(10) if blend.dataset_index[i] == 0) == list(range(5))


def _build_on_two_ranks(rank, world_size, prefix, cache):
    from megatron.core.datasets import gpt_dataset

    if rank != 0:  # the other ranks must load rank 0's files, never build
        gpt_dataset.build_gpt_indices = None
    config = gpt_config(blend=([prefix], None), split="90,10,0", path_to_cache=cache)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, None], lambda: True, config).build()
    only_rank_zero = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, None], lambda: rank == 0, config).build()
    return len(train), train[17]["tokens"].tolist(), np.asarray(valid.shuffle_index).tolist(), only_rank_zero[0] is None


def test_rank_zero_builds_then_the_others_load(corpora, tmp_path):
    results = run_distributed(_build_on_two_ranks, 2, corpora[2], str(tmp_path))
    assert results[0][:3] == results[1][:3]
    assert (results[0][3], results[1][3]) == (False, True)  # not built where is_built_on_rank() is False
    assert len(os.listdir(tmp_path)) == 8  # one set of files for train and valid
