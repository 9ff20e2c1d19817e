"""GPTDataset samples, masks, pad ids, index caches and mock data, as Megatron-LM's gpt_dataset.py builds them."""

import hashlib
import json
import os
from collections import OrderedDict

import numpy as np
import pytest
import torch

from megatron.core.datasets import gpt_dataset, index_cache
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    _get_ltor_masks_and_position_ids,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import resolve_pad_token_id
from megatron.core.datasets.split import Split
from tests.unit_tests.datasets.gpt_fixtures import EOD, StubTokenizer, gpt_config, random_documents, write_dataset


def make_dataset(tmp_path, documents, num_samples, split=Split.train, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prefix = write_dataset(str(tmp_path / "corpus"), documents)
    config.setdefault("path_to_cache", str(tmp_path / "cache"))
    settings = gpt_config(blend=([prefix], None), split="1,0,0", **config)
    low_level = IndexedDataset(prefix)
    indices = np.arange(len(documents), dtype=np.int32)
    return GPTDataset(low_level, prefix, indices, num_samples, split, settings)


def stream_samples(dataset, documents, extra=1):
    """Sample j of the stream, by definition: tokens [j*s, j*s + s + extra) of the documents laid end to
    end in document-index order."""
    stream = np.concatenate([documents[d] for d in dataset.document_index])
    seq = dataset.config.sequence_length
    return [stream[j * seq : j * seq + seq + extra] for j in range(len(dataset))]


def test_samples_are_overlapping_windows_of_the_shuffled_stream(tmp_path):
    documents = random_documents(60, seed=0)
    dataset = make_dataset(tmp_path, documents, num_samples=150)
    windows = stream_samples(dataset, documents)
    assert len(dataset) >= 150
    for i in range(len(dataset)):
        sample = dataset[i]
        window = windows[dataset.shuffle_index[i]]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
    # Consecutive stream samples share one token: every token is a label exactly once.
    assert all(windows[j][-1] == windows[j + 1][0] for j in range(len(windows) - 1))
    sample = dataset[0]
    assert sample["tokens"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.float32
    assert sample["attention_mask"].shape == (1, 8, 8) and sample["attention_mask"].dtype == torch.bool
    assert sample["attention_mask"][0, 0, 1] and not sample["attention_mask"][0, 1, 0]  # True = masked
    assert sample["loss_mask"].tolist() == [1.0] * 8 and sample["position_ids"].tolist() == list(range(8))


def test_last_partial_validation_sample_is_padded(tmp_path):
    documents = [np.arange(1, 12), np.arange(20, 27)]  # 18 tokens, seq 8: ceil(17 / 8) = 3 samples
    dataset = make_dataset(tmp_path, documents, None, Split.valid, drop_last_partial_validation_sequence=False)
    assert len(dataset) == 3
    last = int(np.flatnonzero(np.asarray(dataset.shuffle_index) == 2)[0])
    sample = dataset[last]
    window = stream_samples(dataset, documents)[2]  # 2 real tokens, then padding
    assert sample["tokens"].tolist() == window[:2].tolist() + [0] * 6
    assert sample["labels"].tolist() == window[1:2].tolist() + [0] * 7
    assert sample["loss_mask"].tolist() == [1.0] + [0.0] * 7
    assert make_dataset(tmp_path / "drop", documents, None, Split.valid).__len__() == 2


def test_without_extra_token_the_last_label_is_masked(tmp_path):
    documents = random_documents(20, seed=1)
    dataset = make_dataset(tmp_path, documents, 10, add_extra_token_to_sequence=False)
    windows = stream_samples(dataset, documents, extra=0)
    sample = dataset[0]
    window = windows[dataset.shuffle_index[0]]
    assert sample["tokens"].tolist() == window.tolist()
    assert sample["labels"].tolist() == window[1:].tolist() + [0]
    assert sample["loss_mask"][-1] == 0 and sample["loss_mask"][:-1].eq(1).all()


def classic_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's loop version of the masks (`_get_ltor_masks_and_position_ids`)."""
    seq = data.numel()
    attention_mask = torch.tril(torch.ones((seq, seq))).unsqueeze(0)
    loss_mask = torch.ones(seq)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(seq)
    if reset_position_ids or reset_attention_mask:
        prev_index = 0
        for i in torch.arange(seq)[data == eod].tolist():
            if reset_attention_mask:
                attention_mask[0, i + 1 :, : i + 1] = 0
            if reset_position_ids:
                position_ids[i + 1 :] -= i + 1 - prev_index
                prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)])
def test_masks_and_positions_match_the_classic_loop(flags):
    generator = torch.Generator().manual_seed(sum(flags))
    for _ in range(5):
        data = torch.randint(0, 4, (24,), generator=generator)  # many EODs (id 0), adjacent ones too
        expected = classic_masks(data, 0, *flags)
        actual = _get_ltor_masks_and_position_ids(data, 0, *flags, True)
        for a, e in zip(actual, expected):
            assert torch.equal(a, e)
    assert _get_ltor_masks_and_position_ids(data, 0, *flags, False)[0] is None


def test_reset_flags_in_samples(tmp_path):
    documents = random_documents(30, seed=2, max_length=6)
    dataset = make_dataset(tmp_path, documents, 20, reset_position_ids=True, eod_mask_loss=True)
    sample = dataset[3]
    tokens = sample["tokens"]
    assert sample["loss_mask"].tolist() == (tokens != EOD).float().tolist()
    eods = torch.nonzero(tokens == EOD).flatten().tolist()
    if eods and eods[0] + 1 < len(tokens):
        assert sample["position_ids"][eods[0] + 1] == 0


@pytest.mark.parametrize(
    "tokenizer,allow,expected",
    [
        (StubTokenizer(), False, -1),  # no pad: -1
        (StubTokenizer(pad=5), False, 5),
        (StubTokenizer(pad=EOD), False, -1),  # collides with eod
        (StubTokenizer(pad=EOD), True, EOD),
    ],
)
def test_pad_id_rules(tokenizer, allow, expected):
    assert resolve_pad_token_id(tokenizer, allow) == expected


def expected_cache_hash(prefix, num_samples, split_name):
    """md5 of Megatron-LM's description of this dataset, written out by hand."""
    description = OrderedDict(
        [
            ("class", "GPTDataset"),
            ("dataset_path", prefix),
            ("num_samples", num_samples),
            ("index_split", split_name),
            ("random_seed", 1234),
            ("sequence_length", 8),
            ("split", "1,0,0"),
            ("split_matrix", [[0, 1.0], None, None]),
            ("tokenizer", {"class": "StubTokenizer", "tokenizer_path": ["vocab.json"]}),
        ]
    )
    text = json.dumps(description, indent=4)
    return hashlib.md5(text.encode("utf-8")).hexdigest(), text


def test_cache_files_names_hash_and_reuse(tmp_path, monkeypatch):
    documents = random_documents(40, seed=3)
    first = make_dataset(tmp_path, documents, 50)
    digest, description = expected_cache_hash(str(tmp_path / "corpus"), 50, "train")
    names = sorted(os.listdir(tmp_path / "cache"))
    assert names == sorted(
        f"{digest}-GPTDataset-train-{name}" for name in ["description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"]
    )
    assert (tmp_path / "cache" / f"{digest}-GPTDataset-train-description.txt").read_text() == description

    def no_rebuild(*args, **kwargs):
        raise AssertionError("indices rebuilt although the cache is complete")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", no_rebuild)
    second = GPTDataset(first.dataset, first.dataset_path, first.indices, 50, Split.train, first.config)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(second, name), getattr(first, name))
    assert second[7]["tokens"].tolist() == first[7]["tokens"].tolist()


def test_default_cache_directory_is_next_to_the_data(tmp_path):
    make_dataset(tmp_path, random_documents(20, seed=4), 10, path_to_cache=None)
    assert len(os.listdir(tmp_path / "corpus" / "cache" / "GPTDataset_indices")) == 4


def test_crash_while_writing_leaves_no_cache_that_looks_complete(tmp_path, monkeypatch):
    documents = random_documents(20, seed=5)
    real_save = np.save
    calls = []

    def crashing_save(stream, array, allow_pickle=True):
        calls.append(1)
        if len(calls) == 2:
            stream.write(b"\x93NUMPY partial")
            raise KeyboardInterrupt  # killed mid-write
        real_save(stream, array, allow_pickle=allow_pickle)

    monkeypatch.setattr(index_cache.np, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        make_dataset(tmp_path, documents, 10)
    leftovers = os.listdir(tmp_path / "cache")
    assert not any(name.endswith("sample_index.npy") or name.endswith("description.txt") for name in leftovers)
    assert not any(name.endswith(".incomplete") for name in leftovers)
    monkeypatch.setattr(index_cache.np, "save", real_save)
    rebuilt = make_dataset(tmp_path, documents, 10)
    assert len(os.listdir(tmp_path / "cache")) == 4 and len(rebuilt) >= 10


def test_mock_low_level_dataset():
    mock = MockGPTLowLevelDataset(StubTokenizer(vocab_size=50))
    lengths = np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)
    np.testing.assert_array_equal(mock.sequence_lengths, lengths)
    length = int(lengths[7])
    assert mock[7].tolist() == [k % 50 for k in range(1, length)] + [EOD]
    assert mock.get(7, offset=2, length=3).tolist() == mock[7][2:5].tolist()


def test_mock_dataset_samples(tmp_path):
    config = gpt_config(sequence_length=16)
    assert config.mock and config.split == "1,1,1"
    dataset = MockGPTDataset(MockGPTLowLevelDataset(config.tokenizer), None, np.arange(100, dtype=np.int32), 32, Split.train, config)
    sample = dataset[5]
    assert sorted(sample) == ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]
    assert sample["tokens"].shape == sample["labels"].shape == (16,)
    assert sample["attention_mask"].shape == (1, 16, 16)
    assert dataset[None]["loss_mask"].sum() == 0  # padding sample
    with pytest.raises(ValueError, match="mock config"):
        MockGPTDataset(dataset.dataset, None, dataset.indices, 32, Split.train, gpt_config(blend=(["x"], None), split="1,0,0"))
