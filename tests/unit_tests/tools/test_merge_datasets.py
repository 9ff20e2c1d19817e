"""tools/merge_datasets.py: Megatron's ordering (lexicographic prefixes) and clear errors."""

import os

import numpy as np
import pytest

from ..datasets.test_indexed_dataset import build, read, reference_files
from .tool_loader import load_tool

merge_datasets = load_tool("merge_datasets")


def test_merges_in_lexicographic_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    parts = {"b": [[[5, 6]], [[7]]], "a": [[[1, 2, 3]]], "c": [[[8], [9, 10]]]}
    for name, docs in parts.items():
        build(str(shards / name), docs, np.uint16)
    out = str(tmp_path / "out" / "merged")
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", out]) == 0
    reference_files(str(tmp_path / "ref"), parts["a"] + parts["b"] + parts["c"], np.uint16)
    assert read(out + ".idx") == read(str(tmp_path / "ref.idx"))
    assert read(out + ".bin") == read(str(tmp_path / "ref.bin"))


def test_output_inside_input_dir_is_not_merged_into_itself(tmp_path):
    build(str(tmp_path / "a"), [[[1]]], np.int32)
    build(str(tmp_path / "b"), [[[2]]], np.int32)
    for _ in range(2):  # the second run must not pick up the first run's output
        assert merge_datasets.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "m")]) == 0
    reference_files(str(tmp_path / "ref_only"), [[[1]], [[2]]], np.int32)
    assert read(str(tmp_path / "m.idx")) == read(str(tmp_path / "ref_only.idx"))


def test_mixed_dtypes_are_a_clear_error_and_leave_nothing(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    build(str(shards / "a"), [[[1]]], np.uint16)
    build(str(shards / "b"), [[[2]]], np.int32)
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "m")]) == 1
    assert "b.idx (dtype int32)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["shards"]


def test_unpaired_file_is_named(tmp_path, capsys):
    build(str(tmp_path / "a"), [[[1]]], np.uint16)
    os.remove(tmp_path / "a.idx")
    assert merge_datasets.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "m")]) == 1
    assert "a.idx is missing" in capsys.readouterr().err


@pytest.mark.parametrize("make_dir", [False, True])
def test_missing_or_empty_input_dir(tmp_path, capsys, make_dir):
    target = tmp_path / "nothing"
    if make_dir:
        target.mkdir()
    assert merge_datasets.main(["--input", str(target), "--output-prefix", str(tmp_path / "m")]) == 1
    assert ("holds no .bin/.idx" if make_dir else "is not a directory") in capsys.readouterr().err
