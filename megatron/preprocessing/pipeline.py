"""The preprocessing pipeline: a pool of encoding workers and one ordered writer.

    parent: iter_tasks -> [bounded queue] -> pool.imap (W workers: parse, split, tokenize) -> in-order
            results -> IndexedDatasetBuilder per key (append) -> finalize (atomic rename)

Megatron-LM's design tokenizes in Python, one line per call, with `imap(chunksize=32)` over lines read by
the parent. Here the workers read their own byte ranges, tokenize each task in one batch with the Rust
tokenizers, and return flat numpy arrays, so the parent only appends bytes. Memory stays bounded: at most
`2 * workers + 2` tasks (about 1 MB of text each) are in flight, and the index arrays spill to disk.
"""

import collections
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.tokenizer_record import write_tokenizer_record

from .encoder import EncoderConfig, encode_task, init_worker
from .inputs import iter_tasks, total_input_bytes

_BAD_LINES_SHOWN = 10


class PreprocessError(ValueError):
    """Bad input under `--strict`, or input that cannot be processed at all."""


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    lines: int = 0
    blank_lines: int = 0
    seconds: float = 0.0
    skipped: collections.Counter = field(default_factory=collections.Counter)  # kind -> count
    examples: list = field(default_factory=list)  # "file:line: kind: detail", the first few
    outputs: list = field(default_factory=list)  # the prefixes written

    def report(self) -> str:
        rate = self.text_bytes / 1e6 / max(self.seconds, 1e-9)
        lines = [
            f"Done: {self.documents} documents, {self.tokens} tokens, {self.text_bytes / 1e6:.1f} MB of text in "
            f"{self.seconds:.1f} s ({self.documents / max(self.seconds, 1e-9):.0f} docs/s, {rate:.2f} MB/s, "
            f"{self.tokens / max(self.seconds, 1e-9):.0f} tokens/s)."
        ]
        if self.blank_lines:
            lines.append(f"Ignored {self.blank_lines} blank lines.")
        if self.skipped:
            counts = ", ".join(f"{count} {kind}" for kind, count in sorted(self.skipped.items()))
            lines.append(f"Skipped {sum(self.skipped.values())} lines ({counts}); use --strict to stop at the first:")
            lines.extend("    " + example for example in self.examples)
            hidden = sum(self.skipped.values()) - len(self.examples)
            if hidden > 0:
                lines.append(f"    ... and {hidden} more")
        lines.extend(f"Wrote {prefix}.bin and {prefix}.idx" for prefix in self.outputs)
        return "\n".join(lines)


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool) -> str:
    """Megatron's naming: `{prefix}_{key}_{document|sentence}`."""
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def _format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class _Progress:
    def __init__(self, total_bytes: int, log_interval: int, stream):
        self.total_bytes = max(total_bytes, 1)
        self.log_interval = log_interval
        self.stream = stream
        self.start = time.time()
        self.next_report = log_interval

    def update(self, summary: Summary, done_bytes: int) -> None:
        if self.log_interval <= 0 or summary.documents < self.next_report:
            return
        self.next_report = (summary.documents // self.log_interval + 1) * self.log_interval
        elapsed = max(time.time() - self.start, 1e-9)
        fraction = min(done_bytes / self.total_bytes, 1.0)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else 0.0
        print(
            f"Processed {summary.documents} documents ({summary.documents / elapsed:.0f} docs/s, "
            f"{summary.text_bytes / 1e6 / elapsed:.2f} MB/s), {100 * fraction:.1f}% of input, "
            f"ETA {_format_eta(eta)}.",
            file=self.stream,
            flush=True,
        )


def preprocess(
    paths: list[str],
    output_prefix: str,
    encoder: EncoderConfig,
    workers: int,
    log_interval: int = 1000,
    strict: bool = False,
    max_documents: int | None = None,
    log_stream=None,
    tokenizer_record: dict | None = None,
) -> Summary:
    """Tokenizes every line of `paths` into one dataset per JSON key; writes `tokenizer_record`
    (tokenizer_record.py) next to each. Returns what it did. Input that yields no document at all (an empty
    corpus, every line skipped) raises PreprocessError and leaves no dataset behind."""
    if workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {workers}")
    prefixes = {key: output_prefix_for(output_prefix, key, encoder.split_sentences) for key in encoder.json_keys}
    parent = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(parent, exist_ok=True)

    summary = Summary()
    progress = _Progress(total_input_bytes(paths), log_interval, log_stream or sys.stderr)
    in_flight = threading.BoundedSemaphore(2 * workers + 2)
    stop = threading.Event()
    pending = collections.deque()
    unreadable = []  # an input that cannot be read, raised again by the parent with its origin

    def tasks():
        # Runs in the pool's feeder thread: the semaphore is the back-pressure that bounds memory, and
        # `stop` lets the thread end (so the pool can be closed and joined) when the parent stops early.
        try:
            for task in iter_tasks(paths, max_lines=log_interval if log_interval > 0 else None):
                while not in_flight.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                pending.append(task)
                yield task
        except Exception as error:  # the pool would re-raise it from its own code, without this traceback
            unreadable.append(error)

    builders = {}
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = context.Pool(workers, initializer=init_worker, initargs=(encoder,))
    try:
        builders = {key: IndexedDatasetBuilder(p + ".bin", dtype=encoder.dtype) for key, p in prefixes.items()}
        current_path, line_offset = None, 0
        for result in pool.imap(encode_task, tasks()):
            in_flight.release()
            task = pending.popleft()
            if task.path != current_path:
                current_path, line_offset = task.path, 0
            _record_bad_lines(summary, result, task.path, line_offset, strict)
            line_offset += result.lines
            for key, output in result.outputs.items():
                builders[key].add_documents(output.tokens, output.sequence_lengths, output.sequences_per_document)
            summary.documents += result.documents
            summary.tokens += result.tokens
            summary.text_bytes += result.text_bytes
            summary.lines += result.lines
            summary.blank_lines += result.blank_lines
            progress.update(summary, task.done_bytes)
            if max_documents is not None and summary.documents >= max_documents:
                stop.set()
                break
        if unreadable:
            raise unreadable[0]
        if summary.documents == 0:
            raise PreprocessError(_no_documents(summary, paths))
        for key, builder in builders.items():
            if tokenizer_record is not None:
                write_tokenizer_record(prefixes[key], tokenizer_record)
            builder.finalize(prefixes[key] + ".idx")
            summary.outputs.append(prefixes[key])
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        # The pool is never terminated: a worker killed while it holds a queue's lock (it is writing a result)
        # leaves the pool's task or result handler thread blocked on that lock for ever, and terminate() joins
        # them. Instead `stop` ends the task generator (within its 0.1 s wait), the workers finish the tasks
        # in flight (at most 2 * workers + 2) and exit on close()'s sentinels, and join() returns.
        stop.set()
        pool.close()
        pool.join()
    summary.seconds = time.time() - progress.start
    return summary


def _no_documents(summary: Summary, paths: list[str]) -> str:
    where = paths[0] if len(paths) == 1 else f"{len(paths)} input files ({paths[0]}, ...)"
    if not summary.skipped:
        return f"{where}: no document to write: the input has no non-blank line; nothing was written"
    counts = ", ".join(f"{count} {kind}" for kind, count in sorted(summary.skipped.items()))
    return (f"{where}: no document to write: all {sum(summary.skipped.values())} non-blank lines were skipped "
            f"({counts}), e.g. {summary.examples[0]}; nothing was written")


def _record_bad_lines(summary: Summary, result, path: str, line_offset: int, strict: bool) -> None:
    for index, kind, detail in sorted(result.bad_lines):
        where = f"{path}:{line_offset + index + 1}: {kind}: {detail}"
        if strict:
            raise PreprocessError(f"{where} (--strict stops at the first bad line; nothing was written)")
        summary.skipped[kind] += 1
        if len(summary.examples) < _BAD_LINES_SHOWN:
            summary.examples.append(where)
