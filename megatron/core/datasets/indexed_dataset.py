"""Megatron's memory-mapped token dataset: a `.bin` of raw token ids and an `.idx` that indexes it.

A dataset is a path prefix P with files `P.bin` and `P.idx`. A *sequence* is one tokenized unit (a
document, or a sentence when preprocessing split sentences); a *document* is a run of sequences.

`.bin`: the ids of every sequence back to back, little-endian, in the dataset dtype; nothing else.

`.idx` (little-endian), byte-identical to Megatron-LM's `megatron/core/datasets/indexed_dataset.py`:

    offset        size  content
    0             9     magic b"MMIDIDX\\x00\\x00"
    9             8     version, u64 = 1
    17            1     dtype code, u8 (DType below)
    18            8     S = number of sequences, u64
    26            8     D = number of documents + 1, u64
    34            4*S   sequence_lengths  int32[S]   tokens per sequence
    34+4S         8*S   sequence_pointers int64[S]   BYTE offset of each sequence in .bin
    34+12S        8*D   document_indices  int64[D]   first sequence of each document; [0, ..., S]
    34+12S+8D     1*S   sequence_modes    int8[S]    only when built with multimodal=True (no header flag)

This module imports neither torch nor model code: `tools/preprocess_data.py` runs without torch.
"""

import enum
import os
import shutil
import struct
from functools import lru_cache

import numpy as np

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_SIZE = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8
_SPILL_CHUNK = 1 << 20  # index entries buffered in memory before they are spilled to a side file


class DType(enum.Enum):
    """The `.idx` dtype codes (Megatron's `DType`)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        return cls[np.dtype(dtype).name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> np.dtype:
        return np.dtype(cls(code).name)

    @staticmethod
    def size(key) -> int:
        """Bytes per element, for a dtype code or a numpy dtype."""
        if isinstance(key, int):
            return DType.dtype_from_code(key).itemsize
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type:
        """uint16 when every id fits below 65500 (Megatron's threshold), else int32."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class _Index:
    """The parsed `.idx` of one dataset: three (or four) numpy views into an mmap, validated on load."""

    def __init__(self, idx_path: str, multimodal: bool):
        self.path = idx_path
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE or header[:9] != _INDEX_HEADER:
            raise ValueError(
                f"{idx_path}: not a Megatron .idx file (expected the 34-byte header starting with "
                f"{_INDEX_HEADER!r}, found {header[:9]!r} in a {file_size}-byte file)"
            )
        (version,) = struct.unpack("<Q", header[9:17])
        if version != 1:
            raise ValueError(f"{idx_path}: unsupported .idx version {version} (only version 1 exists)")
        (dtype_code,) = struct.unpack("<B", header[17:18])
        try:
            self.dtype = DType.dtype_from_code(dtype_code)
        except ValueError:
            valid = ", ".join(f"{d.value}={d.name}" for d in DType)
            raise ValueError(f"{idx_path}: unknown dtype code {dtype_code} (valid: {valid})") from None
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])

        S, D = self.sequence_count, self.document_count
        expected = _HEADER_SIZE + 12 * S + 8 * D + (S if multimodal else 0)
        if file_size < expected:
            raise ValueError(
                f"{idx_path}: truncated or corrupt: the header announces {S} sequences and {D - 1} documents, "
                f"which need {expected} bytes, but the file has {file_size}"
            )
        self._mmap = np.memmap(idx_path, mode="r", order="C") if file_size else None
        buffer = memoryview(self._mmap) if self._mmap is not None else b""
        offset = _HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buffer, dtype=np.int32, count=S, offset=offset)
        offset += 4 * S
        self.sequence_pointers = np.frombuffer(buffer, dtype=np.int64, count=S, offset=offset)
        offset += 8 * S
        self.document_indices = np.frombuffer(buffer, dtype=np.int64, count=D, offset=offset)
        offset += 8 * D
        self.sequence_modes = (
            np.frombuffer(buffer, dtype=np.int8, count=S, offset=offset) if multimodal else None
        )
        self._validate()

    def _validate(self) -> None:
        """Cheap consistency checks (O(n) time, bounded extra memory) so corruption fails loudly here."""
        S, docs = self.sequence_count, self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != S:
            raise ValueError(
                f"{self.path}: corrupt document index: it must start at 0 and end at the sequence count {S}, "
                f"found {docs[:1].tolist()} ... {docs[-1:].tolist()}"
            )
        for start in range(0, len(docs) - 1, _SPILL_CHUNK):
            if np.any(np.diff(docs[start : start + _SPILL_CHUNK + 1]) < 0):
                raise ValueError(f"{self.path}: corrupt document index: it decreases near entry {start}")
        if S == 0:
            return
        if self.sequence_lengths.min() < 0:
            raise ValueError(f"{self.path}: corrupt sequence lengths: negative values")
        tokens_before_last = int(self.sequence_lengths[:-1].sum(dtype=np.int64))
        last_pointer = tokens_before_last * self.dtype.itemsize
        if self.sequence_pointers[0] != 0 or self.sequence_pointers[-1] != last_pointer:
            codes = ", ".join(f"{d.value}={d.name}" for d in DType)
            fitting = [d for d in DType if tokens_before_last and DType.size(d.value) * tokens_before_last
                       == self.sequence_pointers[-1] and self.sequence_pointers[0] == 0]
            if fitting:
                # The pointers are byte offsets, so they tell the item size the file was written with.
                raise ValueError(
                    f"{self.path}: the header's dtype code is {DType.code_from_dtype(self.dtype)} "
                    f"({self.dtype.name}), but the sequence pointers were written for a "
                    f"{DType.size(fitting[0].value)}-byte dtype "
                    f"({' or '.join(f'{d.value}={d.name}' for d in fitting)}): "
                    f"the dtype byte (offset 17) was changed or the file is corrupt; valid codes: {codes}"
                )
            raise ValueError(
                f"{self.path}: corrupt sequence pointers: the last one is {int(self.sequence_pointers[-1])} "
                f"but the sequence lengths put it at byte {last_pointer}"
            )

    @property
    def total_bytes(self) -> int:
        """Size the matching `.bin` must have."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize


def _byte_offsets(lengths: np.ndarray, itemsize: int, start: int = 0) -> np.ndarray:
    """Exclusive running sum of `lengths * itemsize` as int64, starting at byte `start`."""
    pointers = np.empty(len(lengths), dtype=np.int64)
    if len(lengths):
        pointers[0] = start
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
        pointers[1:] += start
    return pointers


class IndexedDataset:
    """Random access to the sequences of `P.bin` through `P.idx`, O(1) per sequence.

    `ds[i]` is sequence i as a numpy array, `ds[a:b]` a list of them, `ds.get(i, offset, length)` a slice
    of one sequence. With `mmap=True` (default) arrays are zero-copy views of the mapped `.bin`; with
    `mmap=False` each access reads from the file (for file systems where mmap is slow). Pickling carries
    only the constructor arguments, so DataLoader workers reopen the files.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True):
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = get_idx_path(self.path_prefix), get_bin_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{path} not found: dataset prefix {self.path_prefix!r} needs both {bin_path} and {idx_path} "
                    f"(pass the prefix without extension, e.g. my-gpt2_text_document)"
                )
        self.index = _Index(idx_path, self.multimodal)
        bin_size = os.path.getsize(bin_path)
        if bin_size != self.index.total_bytes:
            raise ValueError(
                f"{bin_path}: size {bin_size} bytes does not match its index, which describes "
                f"{self.index.total_bytes} bytes ({self.index.sequence_count} sequences of "
                f"{self.index.dtype.name}); the file is truncated or belongs to another .idx"
            )
        self._bin_path = bin_path
        self._bin = None
        if self.mmap and bin_size:
            self._bin = np.memmap(bin_path, mode="r", order="C")

    def __getstate__(self):
        return {"path_prefix": self.path_prefix, "multimodal": self.multimodal, "mmap": self.mmap}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self.index.sequence_count

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            sequence = self.get(int(idx))
            if self.multimodal:
                return sequence, self.index.sequence_modes[idx]
            return sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"IndexedDataset slices must be contiguous (step 1), got step {step}")
            return [self.get(i) for i in range(start, stop)]
        raise TypeError(f"IndexedDataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when length is None)."""
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        sequence_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {sequence_length}"
            )
        itemsize = self.index.dtype.itemsize
        start = int(self.index.sequence_pointers[idx]) + offset * itemsize
        if self._bin is not None:
            return np.frombuffer(self._bin, dtype=self.index.dtype, count=length, offset=start)
        out = np.empty(length, dtype=self.index.dtype)
        with open(self._bin_path, "rb") as stream:
            stream.seek(start)
            stream.readinto(memoryview(out).cast("B"))
        return out

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        return self.index.sequence_modes

    def get_document_indices(self) -> np.ndarray:
        return self.index.document_indices

    def set_document_indices(self, document_indices: np.ndarray) -> None:
        """Replaces the document boundaries in memory (Megatron's BERT/T5 datasets use this)."""
        self.index.document_indices = document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


class _SpillArray:
    """An append-only array of one dtype that keeps at most `_SPILL_CHUNK` entries in memory.

    The builder's index arrays grow with the corpus (31M documents broke Megatron's in-memory lists,
    bigcode-project/Megatron-LM#34); here they spill to a side file and are streamed back at `finalize`.
    """

    def __init__(self, path: str, dtype):
        self.path = path
        self.dtype = np.dtype(dtype)
        self._pending: list[np.ndarray] = []
        self._pending_count = 0
        self._stream = None
        self.count = 0

    def extend(self, values) -> None:
        values = np.asarray(values, dtype=self.dtype).reshape(-1)
        self._pending.append(values)
        self._pending_count += len(values)
        self.count += len(values)
        if self._pending_count >= _SPILL_CHUNK:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        if self._stream is None:
            self._stream = open(self.path, "wb")
        self._stream.write(np.concatenate(self._pending).tobytes())
        self._pending, self._pending_count = [], 0

    def chunks(self):
        """Yields the whole array, in order, in chunks of bounded size."""
        if self._stream is not None:
            self._flush()
            self._stream.flush()
            with open(self.path, "rb") as stream:
                while block := stream.read(_SPILL_CHUNK * self.dtype.itemsize):
                    yield np.frombuffer(block, dtype=self.dtype)
        for values in self._pending:
            yield values

    def remove(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if os.path.exists(self.path):
            os.remove(self.path)


@lru_cache(maxsize=None)
def _dtype_bounds(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


class IndexedDatasetBuilder:
    """Writes a dataset: `add_document`/`add_item`/`add_index`, then `finalize(idx_path)`.

    Nothing looks complete before `finalize` returns: tokens go to `<bin_path>.incomplete`, the index
    arrays spill to side files, and `finalize` writes `<idx_path>.incomplete`, removes any older `.idx`,
    then renames the `.bin` and finally the `.idx` into place. A crash at any point leaves no pair that
    `IndexedDataset` would open. Use it as a context manager (or call `abort()`) to remove the partial
    files when something fails.
    """

    def __init__(self, bin_path: str, dtype=np.int32, multimodal: bool = False):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)  # unknown dtypes fail here, not at finalize
        self.multimodal = multimodal
        self._partial_bin = bin_path + ".incomplete"
        self._bin = open(self._partial_bin, "wb")
        self._lengths = _SpillArray(bin_path + ".lengths.incomplete", np.int32)
        self._documents = _SpillArray(bin_path + ".documents.incomplete", np.int64)
        self._documents.extend([0])
        self._modes = _SpillArray(bin_path + ".modes.incomplete", np.int8) if multimodal else None
        self._finalized = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self._finalized:
            self.abort()
        return False

    def _write_tokens(self, tokens) -> np.ndarray:
        array = np.asarray(tokens)
        if array.dtype != self.dtype:
            if array.size and self.dtype.kind in "iu":
                low, high = _dtype_bounds(self.dtype)
                if array.min() < low or array.max() > high:
                    raise ValueError(
                        f"token ids {int(array.min())}..{int(array.max())} do not fit the dataset dtype "
                        f"{self.dtype.name} ({low}..{high}) of {self.bin_path}"
                    )
            array = array.astype(self.dtype)
        self._bin.write(np.ascontiguousarray(array).tobytes())
        return array

    def add_item(self, tokens, mode: int = 0) -> None:
        """Appends one sequence (call `end_document()` after the last sequence of a document)."""
        array = self._write_tokens(tokens)
        self._lengths.extend([array.size])
        if self._modes is not None:
            self._modes.extend([mode])

    def add_document(self, tokens, lengths, modes=None) -> None:
        """Appends one document of `sum(lengths)` tokens made of `len(lengths)` sequences."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        array = self._write_tokens(tokens)
        if int(lengths.sum()) != array.size:
            raise ValueError(f"sequence lengths add up to {int(lengths.sum())} but the document has {array.size} tokens")
        self._lengths.extend(lengths)
        self._documents.extend([self._lengths.count])
        if self._modes is not None:
            self._modes.extend(np.zeros(len(lengths), np.int8) if modes is None else modes)

    def add_documents(self, tokens, sequence_lengths, sequences_per_document) -> None:
        """Appends many documents at once: the bulk form of `add_document` (one write, no Python loop).

        `tokens` holds every token, `sequence_lengths` every sequence's length, and
        `sequences_per_document` how many of those sequences each document spans.
        """
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int32)
        array = self._write_tokens(tokens)
        if int(sequence_lengths.sum(dtype=np.int64)) != array.size:
            raise ValueError(
                f"sequence lengths add up to {int(sequence_lengths.sum(dtype=np.int64))} but {array.size} tokens were given"
            )
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if int(counts.sum()) != len(sequence_lengths):
            raise ValueError(f"documents span {int(counts.sum())} sequences but {len(sequence_lengths)} were given")
        self._documents.extend(self._lengths.count + np.cumsum(counts))
        self._lengths.extend(sequence_lengths)
        if self._modes is not None:
            self._modes.extend(np.zeros(len(sequence_lengths), np.int8))

    def end_document(self) -> None:
        self._documents.extend([self._lengths.count])

    def add_index(self, path_prefix: str) -> None:
        """Appends every document of another dataset (same dtype) after the ones written so far."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {get_idx_path(path_prefix)} (dtype {other.dtype.name}) into {self.bin_path} "
                f"(dtype {self.dtype.name}): all datasets must share one dtype"
            )
        offset = self._lengths.count
        self._lengths.extend(other.sequence_lengths)
        self._documents.extend(other.document_indices[1:] + offset)
        if self._modes is not None:
            self._modes.extend(other.sequence_modes)
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Writes the `.idx` and moves both files into place (the `.idx` last)."""
        self._bin.close()
        partial_idx = idx_path + ".incomplete"
        try:
            with open(partial_idx, "wb") as stream:
                self._write_index(stream)
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(self._partial_bin, self.bin_path)
            os.replace(partial_idx, idx_path)
        except BaseException:
            if os.path.exists(partial_idx):
                os.remove(partial_idx)
            self.abort()
            raise
        self._finalized = True
        for array in self._spill_arrays():
            array.remove()

    def _write_index(self, stream) -> None:
        S, D = self._lengths.count, self._documents.count
        stream.write(_INDEX_HEADER)
        stream.write(struct.pack("<Q", 1))
        stream.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        stream.write(struct.pack("<Q", S))
        stream.write(struct.pack("<Q", D))
        for lengths in self._lengths.chunks():
            stream.write(lengths.tobytes())
        next_byte = 0
        for lengths in self._lengths.chunks():
            pointers = _byte_offsets(lengths, self.dtype.itemsize, start=next_byte)
            stream.write(pointers.tobytes())
            next_byte += int(lengths.astype(np.int64).sum()) * self.dtype.itemsize
        for documents in self._documents.chunks():
            stream.write(documents.tobytes())
        if self._modes is not None:
            for modes in self._modes.chunks():
                stream.write(modes.tobytes())

    def _spill_arrays(self):
        return [a for a in (self._lengths, self._documents, self._modes) if a is not None]

    def abort(self) -> None:
        """Closes and deletes everything this builder wrote; the final paths are left untouched."""
        if self._finalized:
            return
        if not self._bin.closed:
            self._bin.close()
        if os.path.exists(self._partial_bin):
            os.remove(self._partial_bin)
        for array in self._spill_arrays():
            array.remove()
