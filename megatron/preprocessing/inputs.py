"""Input discovery and task slicing for the preprocessing pipeline.

`--input` may be a file, a glob, or a directory (every `.json`, `.jsonl`, optionally `.gz`/`.zst`, below
it, in sorted order). Plain files are cut into byte ranges that end on a line break, so workers read their
own slice and the parent never touches the text; compressed files are decompressed by the parent and sent
as blocks of lines. Either way a `Task` carries no more than about `TASK_BYTES` of text, which bounds memory
whatever the input size (Megatron-LM's script runs out of memory on large inputs: NVIDIA/Megatron-LM#444, #154).
With `max_lines` (the progress interval) a task also holds at most that many lines, so that progress can be
reported every `max_lines` documents; the parent then reads each slice once to find its line breaks.
"""

import glob
import gzip
import io
import os
import zlib
from dataclasses import dataclass

TASK_BYTES = 1 << 20
_EXTENSIONS = (".json", ".jsonl", ".ndjson")
_COMPRESSED = (".gz", ".zst")


@dataclass
class Task:
    """A slice of one input file: `data` (raw lines) or the byte range [`start`, `end`) of `path`.

    `done_bytes` is how far into the input, counted in on-disk (compressed) bytes over all files, the
    end of this task lies: the numerator of the progress ETA.
    """

    path: str
    start: int = 0
    end: int = 0
    data: bytes | None = None
    done_bytes: int = 0

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        with open(self.path, "rb") as stream:
            stream.seek(self.start)
            return stream.read(self.end - self.start)

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.end - self.start


def _is_input_file(path: str) -> bool:
    name = path.lower()
    for suffix in _COMPRESSED:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.endswith(_EXTENSIONS)


def find_input_files(pattern: str) -> list[str]:
    """Files named by `--input`: a path, a glob, or a directory searched recursively; sorted."""
    if os.path.isdir(pattern):
        found = [
            os.path.join(root, name)
            for root, _, names in os.walk(pattern)
            for name in names
            if _is_input_file(name)
        ]
        if not found:
            raise ValueError(
                f"--input {pattern}: the directory holds no .json/.jsonl files (optionally .gz or .zst compressed)"
            )
        return sorted(found)
    if os.path.isfile(pattern):
        return [pattern]
    found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not found:
        raise ValueError(f"--input {pattern}: no such file, and no file matches it as a glob pattern")
    return found


def _open_decompressed(path: str, raw):
    """A decompressing reader over the open file `raw`, or None when `path` is not compressed."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(
                f"--input {path}: reading .zst files needs the zstandard package: pip install zstandard"
            ) from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return None


def _line_cuts(data: bytes, max_lines: int | None) -> list[int]:
    """Offsets into `data` that cut it into pieces of at most `max_lines` lines, ending with len(data)."""
    cuts, position = [], 0
    while max_lines is not None:
        for _ in range(max_lines):
            position = data.find(b"\n", position) + 1
            if position == 0:
                return cuts + [len(data)]
        if position == len(data):
            break
        cuts.append(position)
    return cuts + [len(data)]


def _byte_ranges(path: str, done_before: int, max_lines: int | None):
    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        start = 0
        while start < size:
            stream.seek(min(start + TASK_BYTES, size))
            stream.readline()  # move the cut to the end of the line it falls in
            end = min(stream.tell(), size)
            cuts = [end - start]
            if max_lines is not None:
                stream.seek(start)
                cuts = _line_cuts(stream.read(end - start), max_lines)
            piece_start = start
            for cut in cuts:
                yield Task(path, piece_start, start + cut, done_bytes=done_before + start + cut)
                piece_start = start + cut
            start = end


def _decompressed_blocks(path: str, stream, raw, done_before: int, max_lines: int | None):
    try:
        while block := stream.read(TASK_BYTES):
            block += stream.readline()
            piece_start = 0
            for cut in _line_cuts(block, max_lines):
                yield Task(path, data=block[piece_start:cut], done_bytes=done_before + raw.tell())
                piece_start = cut
    except Exception as error:
        # gzip says "Not a gzipped file (b'ab')" or "Compressed file ended before the end-of-stream marker"
        # without the file's name.
        if not isinstance(error, (OSError, EOFError, zlib.error)) and type(error).__name__ != "ZstdError":
            raise
        raise ValueError(f"{path}: cannot be decompressed, the file is corrupt or not {path.rsplit('.', 1)[-1]} "
                         f"data ({type(error).__name__}: {error})") from None


def iter_tasks(paths: list[str], max_lines: int | None = None):
    """Yields `Task`s covering every line of `paths`, in input order; with `max_lines`, none holds more lines."""
    done_before = 0
    for path in paths:
        with open(path, "rb") as raw:
            stream = _open_decompressed(path, raw)
            if stream is None:
                yield from _byte_ranges(path, done_before, max_lines)
            else:
                yield from _decompressed_blocks(path, stream, raw, done_before, max_lines)
        done_before += os.path.getsize(path)


def total_input_bytes(paths: list[str]) -> int:
    """Bytes on disk (compressed size for compressed files): the denominator of the progress ETA."""
    return sum(os.path.getsize(p) for p in paths)
