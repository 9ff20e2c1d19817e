"""What tools/preprocess_data.py leaves for training to check: the tokenizer record next to the dataset
(which merge_datasets.py carries over, or refuses to mix), the first document of a file that starts with a
UTF-8 byte order mark, and a progress line every --log-interval documents. (Empty output and corrupt input
are rows of tests/functional_tests/bad_inputs_run.py.)"""

import json
import os

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.tokenizer_record import read_tokenizer_record

from .tool_loader import load_tool

preprocess_data = load_tool("preprocess_data")
# A hang in the worker pool fails the test instead of blocking the run (conftest.py).
pytestmark = pytest.mark.usefixtures("hang_guard")


def _gpt2_files(tmp_path) -> list:
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
            "--merge-file", str(tmp_path / "merges.txt")]


def test_bom_record_and_progress_every_n_documents(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\xef\xbb\xbf" + b"".join(b'{"text": "%s"}\n' % (b"ab" * (i + 1)) for i in range(7)))
    prefix = str(tmp_path / "out")
    argv = ["--input", str(corpus), "--output-prefix", prefix, "--workers", "1", "--log-interval", "2"]
    assert preprocess_data.main(argv + _gpt2_files(tmp_path)) == 0

    dataset = IndexedDataset(prefix + "_text_document")
    assert len(dataset) == 7 and dataset[0].tolist() == [2]  # the first document, after the BOM, is kept
    record = read_tokenizer_record(prefix + "_text_document")
    assert record["tokenizer_type"] == "GPT2BPETokenizer" and record["vocab_size"] == 4
    assert set(record["vocabulary_files"]) == {"vocab_file", "merge_file"}
    progress = [line.split(" documents")[0] for line in capsys.readouterr().err.splitlines()
                if line.startswith("Processed ")]
    assert progress == ["Processed 2", "Processed 4", "Processed 6"]


def test_merge_keeps_a_common_tokenizer_record_and_refuses_two_vocabularies(tmp_path, capsys):
    from megatron.core.datasets.tokenizer_record import write_tokenizer_record

    from ..datasets.test_indexed_dataset import build

    merge_datasets = load_tool("merge_datasets")
    shards = tmp_path / "shards"
    shards.mkdir()
    gpt2 = {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": 4, "vocabulary_files": {"vocab_file": "1"}, "name": None}
    for name in ("a", "b"):
        build(str(shards / name), [[[1, 2]]], np.uint16)
        write_tokenizer_record(str(shards / name), gpt2)
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "m")]) == 0
    assert read_tokenizer_record(str(tmp_path / "m")) == gpt2

    write_tokenizer_record(str(shards / "b"), {**gpt2, "vocabulary_files": {"vocab_file": "2"}})
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "n")]) == 1
    assert "shards/a was tokenized with GPT2BPETokenizer (4 ids; vocab_file sha256 1) but" in capsys.readouterr().err
    assert not any(name.startswith("n") for name in os.listdir(tmp_path))
