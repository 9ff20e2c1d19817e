"""`.bin/.idx` against a byte layout written independently here from Megatron-LM's format."""

import os
import pickle
import struct

import numpy as np
import pytest

from megatron.core.datasets import indexed_dataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def reference_files(prefix, documents, dtype, modes=None):
    """Writes `prefix.bin/.idx` the way Megatron-LM lays them out, with struct and numpy only.

    `documents` is a list of documents, each a list of sequences (lists of ids).
    """
    sequences = [np.asarray(seq, dtype=dtype) for doc in documents for seq in doc]
    lengths = [len(s) for s in sequences]
    itemsize = np.dtype(dtype).itemsize
    pointers, position = [], 0
    for length in lengths:
        pointers.append(position)
        position += length * itemsize
    doc_index = [0]
    for doc in documents:
        doc_index.append(doc_index[-1] + len(doc))
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(s.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))
        if modes is not None:
            f.write(struct.pack(f"<{len(modes)}b", *modes))


def build(prefix, documents, dtype, multimodal=False):
    with IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal) as builder:
        for doc in documents:
            builder.add_document(np.concatenate([np.asarray(s) for s in doc]) if doc else [], [len(s) for s in doc])
        builder.finalize(prefix + ".idx")


def read(path):
    with open(path, "rb") as f:
        return f.read()


def random_documents(rng, count, vocab, sentences=1):
    return [
        [rng.integers(0, vocab, size=rng.integers(0, 40)).tolist() for _ in range(rng.integers(1, sentences + 1))]
        for _ in range(count)
    ]


def test_worked_example_from_reference(tmp_path):
    # Two documents [10,11,12,50256], [20,21,50256] with uint16 (reference 1.2, "Verified by ...").
    prefix = str(tmp_path / "ours")
    build(prefix, [[[10, 11, 12, 50256]], [[20, 21, 50256]]], np.uint16)
    expected = (
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 2, 3) + struct.pack("<2i", 4, 3)
        + struct.pack("<2q", 0, 8) + struct.pack("<3q", 0, 1, 2)
    )
    assert read(prefix + ".idx") == expected
    assert read(prefix + ".bin") == np.array([10, 11, 12, 50256, 20, 21, 50256], np.uint16).tobytes()


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_writer_is_byte_identical_to_reference(tmp_path, dtype):
    rng = np.random.default_rng(int(DTYPE_CODES[dtype]))
    docs = random_documents(rng, 50, 120, sentences=4)
    build(str(tmp_path / "ours"), docs, dtype)
    reference_files(str(tmp_path / "ref"), docs, dtype)
    for ext in (".bin", ".idx"):
        assert read(str(tmp_path / "ours") + ext) == read(str(tmp_path / "ref") + ext)


def test_reader_reads_reference_files(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_documents(rng, 30, 60000, sentences=3)
    prefix = str(tmp_path / "ref")
    reference_files(prefix, docs, np.uint16)
    ds = IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat) and ds.dtype == np.uint16
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
    expected_docs = np.cumsum([0] + [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, expected_docs)
    longest = int(np.argmax([len(s) for s in flat]))
    np.testing.assert_array_equal(ds.get(longest, offset=2, length=5), flat[longest][2:7])
    np.testing.assert_array_equal(ds.get(longest, offset=3), flat[longest][3:])
    assert [a.tolist() for a in ds[1:4]] == flat[1:4]


def test_multimodal_modes_round_trip(tmp_path):
    docs = [[[1, 2], [3]], [[4, 5, 6]]]
    prefix = str(tmp_path / "mm")
    reference_files(prefix, docs, np.int32, modes=[0, 1, 0])
    ds = IndexedDataset(prefix, multimodal=True)
    assert ds[1][1] == 1 and ds.sequence_modes.tolist() == [0, 1, 0]
    ours = str(tmp_path / "ours")
    with IndexedDatasetBuilder(ours + ".bin", dtype=np.int32, multimodal=True) as builder:
        builder.add_document([1, 2, 3], [2, 1], modes=[0, 1])
        builder.add_document([4, 5, 6], [3], modes=[0])
        builder.finalize(ours + ".idx")
    assert read(ours + ".idx") == read(prefix + ".idx")


def test_pickle_and_no_mmap_reopen(tmp_path):
    prefix = str(tmp_path / "p")
    build(prefix, [[[1, 2, 3]], [[4, 5]]], np.int32)
    clone = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert clone[1].tolist() == [4, 5]
    plain = IndexedDataset(prefix, mmap=False)
    assert plain.get(0, 1, 2).tolist() == [2, 3]


def test_add_index_merges_and_add_item_form(tmp_path):
    a, b, merged = (str(tmp_path / n) for n in ("a", "b", "m"))
    build(a, [[[1, 2]], [[3]]], np.uint16)
    with IndexedDatasetBuilder(b + ".bin", dtype=np.uint16) as builder:
        builder.add_item([4, 5, 6])
        builder.add_item([7])
        builder.end_document()
        builder.finalize(b + ".idx")
    with IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16) as builder:
        builder.add_index(a)
        builder.add_index(b)
        builder.finalize(merged + ".idx")
    reference_files(str(tmp_path / "ref"), [[[1, 2]], [[3]], [[4, 5, 6], [7]]], np.uint16)
    assert read(merged + ".idx") == read(str(tmp_path / "ref.idx"))
    assert read(merged + ".bin") == read(str(tmp_path / "ref.bin"))


def test_add_index_rejects_other_dtype(tmp_path):
    build(str(tmp_path / "a"), [[[1]]], np.int32)
    with IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16) as builder:
        with pytest.raises(ValueError, match=r"a\.idx \(dtype int32\).*dtype uint16"):
            builder.add_index(str(tmp_path / "a"))
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]


def test_index_arrays_spill_to_disk_and_stream_back(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed_dataset, "_SPILL_CHUNK", 7)
    rng = np.random.default_rng(1)
    docs = random_documents(rng, 100, 1000, sentences=3)
    build(str(tmp_path / "ours"), docs, np.uint16)
    reference_files(str(tmp_path / "ref"), docs, np.uint16)
    assert read(str(tmp_path / "ours.idx")) == read(str(tmp_path / "ref.idx"))
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx", "ref.bin", "ref.idx"]


def test_failed_build_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16) as builder:
            builder.add_document([1, 2], [2])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_unfinalized_builder_is_not_a_dataset(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    builder.add_document([1, 2], [2])
    assert not IndexedDataset.exists(str(tmp_path / "x"))
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_ids_that_do_not_fit_the_dtype_are_an_error(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16) as builder:
        with pytest.raises(ValueError, match=r"0\.\.70000 do not fit the dataset dtype uint16"):
            builder.add_document(np.array([0, 70000]), [2])


def test_optimal_dtype_threshold():
    assert DType.optimal_dtype(50257) == np.uint16
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    assert DType.optimal_dtype(128256) == np.int32
    assert DType.code_from_dtype(np.uint16) == 8 and DType.dtype_from_code(4) == np.int32


@pytest.fixture
def small_dataset(tmp_path):
    prefix = str(tmp_path / "d")
    build(prefix, [[[1, 2, 3]], [[4, 5]]], np.uint16)
    return prefix


def _rewrite(path, edit):
    data = bytearray(read(path))
    edit(data)
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.__setitem__(slice(0, 9), b"NOTANIDX\x00"), "not a Megatron .idx file"),
        (lambda d: d.__setitem__(slice(9, 17), struct.pack("<Q", 2)), "unsupported .idx version 2"),
        (lambda d: d.__setitem__(17, 9), "unknown dtype code 9"),
        (lambda d: d.__delitem__(slice(len(d) - 4, len(d))), "truncated or corrupt"),
        (lambda d: d.__setitem__(slice(len(d) - 8, len(d)), struct.pack("<q", 5)), "corrupt document index"),
        (lambda d: d.__setitem__(slice(34 + 8 + 8, 34 + 8 + 16), struct.pack("<q", 4)), "corrupt sequence pointers"),
        (lambda d: d.__delitem__(slice(20, len(d))), "not a Megatron .idx file|truncated"),
    ],
)
def test_corrupt_index_is_a_clear_error(small_dataset, edit, message):
    _rewrite(small_dataset + ".idx", edit)
    with pytest.raises(ValueError, match=message):
        IndexedDataset(small_dataset)


def test_truncated_bin_is_a_clear_error(small_dataset):
    _rewrite(small_dataset + ".bin", lambda d: d.__delitem__(slice(len(d) - 2, len(d))))
    with pytest.raises(ValueError, match=r"d\.bin: size 8 bytes does not match its index, which describes 10"):
        IndexedDataset(small_dataset)


def test_missing_file_names_both_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.idx not found.*needs both"):
        IndexedDataset(str(tmp_path / "nope"))


def test_out_of_range_access(small_dataset):
    ds = IndexedDataset(small_dataset)
    with pytest.raises(IndexError, match="out of range for 2 sequences"):
        ds[5]
    with pytest.raises(IndexError, match="tokens \\[2, 5\\) out of range for sequence 0 of length 3"):
        ds.get(0, offset=2, length=3)
