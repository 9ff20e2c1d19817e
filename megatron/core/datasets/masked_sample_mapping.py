"""`build_mapping`: the BERT/T5 sample mapping of Megatron's `helpers.cpp`, in numpy and Python.

A sample is a run of consecutive sentences of one document, `(first_sentence, last_sentence + 1,
target_length)`. The C++ walks the documents of a split epoch after epoch:

* a document is skipped if it has fewer than `min_num_sent` sentences, or if it has more than one
  sentence and one of them is longer than 512 tokens;
* otherwise a target length is drawn, and sentences are taken until the sample holds at least the
  target number of tokens and at least `min_num_sent` sentences and more than one sentence of the
  document remains - or until the document ends; the sample is emitted and a new target is drawn
  (also after the document's last sample: that draw is never used);
* a target is `2 + r % (max_seq_length - 1)` when `r % round(1 / short_seq_prob) == 0`, else
  `max_seq_length`, with `r` the next raw output of `std::mt19937(seed)` (no draw when
  `short_seq_prob == 0`);
* epochs continue while fewer than `max_num_samples` samples exist at the start of an epoch, so whole
  epochs are built; finally the rows are shuffled by Fisher-Yates with `std::mt19937_64(seed + 1)`.

Worked example (min_num_sent 1, max_seq_length 10, no short samples): a document of sentences with
4, 3, 5, 2, 6 tokens gives (0, 3, 10) since 4+3+5 >= 10 with two sentences left, then (3, 5, 10) at
the document's end.

The sample that starts at sentence a with target t ends at the first sentence s where the tokens of
a..s reach t and s >= a + min_num_sent - 1 (a `searchsorted` on token prefix sums), unless fewer than
two sentences would remain after s, in which case it runs to the end of the document. With every
target at its maximum, each document's samples are fixed, so they are computed once, for all documents
at once. The sequential walk, which follows the random stream, only has to check per document whether
the draws it consumes are all maximal (most are, with `short_seq_prob` 0.1) and walks the others
sentence run by sentence run.
"""

import bisect
import logging
import math

import numpy as np

from megatron.core.datasets.fisher_yates import fisher_yates_order
from megatron.core.datasets.mersenne_twister import MT19937_64, mt19937_stream

logger = logging.getLogger(__name__)

LONG_SENTENCE_LEN = 512
"""Multi-sentence documents with a sentence longer than this are skipped (helpers.cpp)."""

_DOCUMENTS_PER_BLOCK = 1 << 16  # documents walked per batch of Python-list conversions
_DRAWS_PER_WINDOW = 1 << 16  # random draws converted to Python lists at a time


def build_mapping(
    documents: np.ndarray,
    sizes: np.ndarray,
    num_epochs: int,
    max_num_samples: int | None,
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    verbose: bool,
    min_num_sent: int,
) -> np.ndarray:
    """The shuffled sample mapping, `[num_samples, 3]` rows `(first, last + 1, target_length)`.

    Args:
        documents: sentence boundaries of the documents, `[num_documents + 1]`: document d holds the
            sentences `[documents[d], documents[d + 1])` (global sentence ids).
        sizes: tokens per sentence, for every sentence of the dataset.
        num_epochs: the most epochs to walk.
        max_num_samples: stop at the end of the first epoch that reaches this many samples; None for
            no limit (then `num_epochs` epochs).
        max_seq_length: the longest target (BERT: sequence length - 3, T5: - 2).
        short_seq_prob: probability of a shorter random target (`--short-seq-prob`).
        seed: the generators' seed (`--seed`, > 0).
        verbose: log the document counts.
        min_num_sent: sentences per sample at least (2 for BERT with sentence-order prediction, else 1).

    Rows are uint32, or uint64 when there are more than 2^32 - 1 sentences (as in helpers.cpp).
    """
    short_seq_ratio = _check_arguments(num_epochs, max_seq_length, short_seq_prob, seed, min_num_sent)
    documents = np.asarray(documents, dtype=np.int64)
    sizes = np.asarray(sizes)
    dtype = np.uint64 if sizes.size > np.iinfo(np.uint32).max else np.uint32
    walker = _DocumentWalker(documents, sizes, max_seq_length, min_num_sent)
    if verbose:
        walker.log_document_counts()
    limit = math.inf if max_num_samples is None else max_num_samples

    targets = None if short_seq_ratio == 0 else _TargetStream(seed, short_seq_ratio, max_seq_length)
    epochs, num_samples = [], 0
    for _ in range(num_epochs):
        if num_samples >= limit:
            break
        rows = walker.fixed_rows if targets is None else walker.walk_epoch(targets)
        if len(rows) == 0:
            raise ValueError(
                f"no sample can be made from these {walker.num_documents} documents: each needs at least "
                f"{min_num_sent} sentence(s), and documents of several sentences must have none longer than "
                f"{LONG_SENTENCE_LEN} tokens ({walker.describe_skipped()})"
            )
        epochs.append(rows.astype(dtype))  # the narrow type at once: many epochs may be needed
        num_samples += len(rows)
    if verbose:
        logger.info(f"   will create mapping for {num_samples} samples from {len(epochs)} epoch(s)")

    mapping = np.concatenate(epochs) if epochs else np.empty((0, 3), dtype=dtype)
    return mapping[fisher_yates_order(num_samples, MT19937_64(seed + 1))]


def _check_arguments(num_epochs, max_seq_length, short_seq_prob, seed, min_num_sent) -> int:
    """Raises for what helpers.cpp asserts; returns the short-sample ratio `round(1 / short_seq_prob)`."""
    problems = []
    if num_epochs < 1:
        problems.append(f"num_epochs must be at least 1, got {num_epochs}")
    if max_seq_length < 2:
        problems.append(f"max_seq_length must be at least 2, got {max_seq_length}")
    if not 0.0 <= short_seq_prob <= 1.0:
        problems.append(f"short_seq_prob (--short-seq-prob) must be in [0, 1], got {short_seq_prob}")
    if not 0 < seed < 2**31 - 1:
        problems.append(f"seed (--seed) must be in [1, 2^31 - 2] for the BERT/T5 sample mapping, got {seed}")
    if min_num_sent < 1:
        problems.append(f"min_num_sent must be at least 1, got {min_num_sent}")
    short_seq_ratio = 0
    if not problems and short_seq_prob > 0:
        short_seq_ratio = math.floor(1.0 / short_seq_prob + 0.5)  # C's round(): halves away from zero
        if short_seq_ratio > np.iinfo(np.int32).max:
            problems.append(f"short_seq_prob (--short-seq-prob) {short_seq_prob} is below 2^-31; use 0 for none")
    if problems:
        raise ValueError("build_mapping: " + "; ".join(problems))
    return short_seq_ratio


class _TargetStream:
    """The target lengths drawn from `std::mt19937(seed)`. `window(start, count)` returns the targets
    of draws `[start, start + count)` and, for each, the index of the next draw whose target is below
    the maximum; draws before `start` are forgotten."""

    def __init__(self, seed: int, short_seq_ratio: int, max_seq_length: int):
        self.generator = mt19937_stream(seed)
        self.short_seq_ratio = np.uint64(short_seq_ratio)
        self.max_seq_length = max_seq_length
        self.start = 0  # index of draws[0] in the stream
        self.draws = np.empty(0, dtype=np.uint64)

    def forget_before(self, start: int) -> None:
        self.draws = self.draws[start - self.start :]
        self.start = start

    def window(self, start: int, count: int) -> tuple[list[int], list[int]]:
        self.forget_before(start)
        if len(self.draws) < count:
            self.draws = np.concatenate([self.draws, self.generator.random_raw(count - len(self.draws))])
        draws = self.draws[:count]
        short = draws % self.short_seq_ratio == 0
        targets = np.where(short, 2 + draws % np.uint64(self.max_seq_length - 1), self.max_seq_length)
        targets = targets.astype(np.int64)
        below = np.where(targets != self.max_seq_length, np.arange(count), count)
        next_short = np.minimum.accumulate(below[::-1])[::-1] + start
        return targets.tolist(), next_short.tolist()


class _DocumentWalker:
    """The documents of one split, their fixed (all-maximal-target) samples and the random walk."""

    def __init__(self, documents: np.ndarray, sizes: np.ndarray, max_seq_length: int, min_num_sent: int):
        self.max_seq_length = max_seq_length
        self.min_num_sent = min_num_sent
        self.num_documents = len(documents) - 1
        first, last = documents[:-1], documents[1:]
        num_sentences = last - first
        # Token prefix sums over the split's sentences: tokens of sentences [a, b) = prefix[b] - prefix[a].
        self.offset = int(documents[0])
        local_sizes = np.asarray(sizes[documents[0] : documents[-1]], dtype=np.int64)
        self.prefix = np.concatenate([[0], np.cumsum(local_sizes)])
        long_sentences = np.flatnonzero(local_sizes > LONG_SENTENCE_LEN) + self.offset
        has_long = np.zeros(self.num_documents, dtype=bool)
        has_long[np.searchsorted(documents, long_sentences, side="right") - 1] = True
        has_long &= num_sentences > 1
        self.empty = int((num_sentences == 0).sum())
        self.single = int((num_sentences == 1).sum())
        self.long = int(has_long.sum())
        used = (num_sentences >= min_num_sent) & ~has_long
        self.first = first[used] - self.offset
        self.last = last[used] - self.offset
        self.fixed_rows, self.fixed_counts = self._fixed_samples()
        self.fixed_offsets = np.concatenate([[0], np.cumsum(self.fixed_counts)])

    def describe_skipped(self) -> str:
        return (
            f"{self.empty} empty, {self.single} with one sentence, {self.long} with a sentence over "
            f"{LONG_SENTENCE_LEN} tokens"
        )

    def log_document_counts(self) -> None:
        logger.info(
            f"    {self.num_documents} documents, sentences [{self.offset}, {self.offset + len(self.prefix) - 1}): "
            f"{self.describe_skipped()}; {len(self.first)} used"
        )

    def _sample_ends(self, starts: np.ndarray, targets, lasts: np.ndarray) -> np.ndarray:
        """One past the last sentence of the samples starting at `starts` (local ids) with `targets`,
        in documents ending at `lasts` (exclusive)."""
        reached = np.searchsorted(self.prefix, self.prefix[starts] + targets, side="left")  # s + 1
        ends = np.maximum(reached, starts + self.min_num_sent)
        return np.where(ends > lasts - 2, lasts, ends)  # under two sentences would remain: take them too

    def _fixed_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows `[n, 3]` (global ids) of every used document's samples when every target is maximal,
        in document order, and the number of samples of each document."""
        document = np.arange(len(self.first))
        starts, lasts = self.first.copy(), self.last
        pieces_document, pieces_start, pieces_end = [], [], []
        while len(document):
            ends = self._sample_ends(starts, self.max_seq_length, lasts)
            pieces_document.append(document)
            pieces_start.append(starts)
            pieces_end.append(ends)
            going_on = ends < lasts
            document, starts, lasts = document[going_on], ends[going_on], lasts[going_on]
        if not pieces_document:
            return np.empty((0, 3), dtype=np.int64), np.zeros(0, dtype=np.int64)
        document = np.concatenate(pieces_document)
        order = np.argsort(document, kind="stable")  # (document, sample) order
        rows = np.empty((len(document), 3), dtype=np.int64)
        rows[:, 0] = np.concatenate(pieces_start)[order] + self.offset
        rows[:, 1] = np.concatenate(pieces_end)[order] + self.offset
        rows[:, 2] = self.max_seq_length
        return rows, np.bincount(document, minlength=len(self.first))

    def walk_epoch(self, targets: _TargetStream) -> np.ndarray:
        """The rows of one epoch, following the target stream from where the last epoch left it.

        A document whose samples would consume only maximal targets gets its fixed samples; the others
        are walked with their targets, one `bisect` per sample.
        """
        pieces = []
        clock = base = targets.start
        # A document draws at most one target per sentence, plus one.
        window = min(int((self.last - self.first).sum()) + len(self.first), _DRAWS_PER_WINDOW)
        drawn, next_short = targets.window(clock, window)
        for block_first in range(0, len(self.first), _DOCUMENTS_PER_BLOCK):
            block_last = min(block_first + _DOCUMENTS_PER_BLOCK, len(self.first))
            firsts = self.first[block_first:block_last].tolist()
            lasts = self.last[block_first:block_last].tolist()
            fixed_counts = self.fixed_counts[block_first:block_last].tolist()
            walked_documents, walked_counts, walked_rows = [], [], []
            for index, count in enumerate(fixed_counts):
                most_draws = lasts[index] - firsts[index] + 1
                if clock + most_draws > base + len(drawn):
                    drawn, next_short = targets.window(clock, max(most_draws, window))
                    base = clock
                if next_short[clock - base] >= clock + count:
                    clock += count + 1
                    continue
                rows, clock = self._walk_document(firsts[index], lasts[index], drawn, base, clock)
                walked_documents.append(index)
                walked_counts.append(len(rows))
                walked_rows += rows
            pieces.append(self._assemble(block_first, block_last, walked_documents, walked_counts, walked_rows))
        targets.forget_before(clock)
        return np.concatenate(pieces) if pieces else np.empty((0, 3), dtype=np.int64)

    def _walk_document(self, first, last, drawn, base, clock) -> tuple[list[tuple[int, int, int]], int]:
        """The samples of the document of sentences `[first, last)` (local ids) with the targets
        `drawn[clock - base:]`; returns them and the clock after the document (samples + 1 draws)."""
        rows = []
        tokens_before = self.prefix[first : last + 1].tolist()  # tokens_before[i] = prefix[first + i]
        start = first
        while start < last:
            target = drawn[clock - base]
            clock += 1
            needed = tokens_before[start - first] + target
            reached = first + bisect.bisect_left(tokens_before, needed, start - first + 1)
            end = max(reached, start + self.min_num_sent)
            if end > last - 2:  # as in _sample_ends
                end = last
            rows.append((start + self.offset, end + self.offset, target))
            start = end
        return rows, clock + 1

    def _assemble(self, block_first, block_last, walked_documents, walked_counts, walked_rows) -> np.ndarray:
        """The rows of used documents `[block_first, block_last)` in order: the fixed rows of each,
        except the walked documents (block-relative indices) which have `walked_rows`."""
        counts = self.fixed_counts[block_first:block_last].copy()
        walked = np.zeros(len(counts), dtype=bool)
        walked[walked_documents] = True
        counts[walked_documents] = walked_counts
        row_document = np.repeat(np.arange(len(counts)), counts)  # block-relative document of each row
        row_in_document = np.arange(len(row_document)) - (np.cumsum(counts) - counts)[row_document]
        from_walk = walked[row_document]
        rows = np.empty((len(row_document), 3), dtype=np.int64)
        fixed_document = row_document[~from_walk] + block_first
        rows[~from_walk] = self.fixed_rows[self.fixed_offsets[fixed_document] + row_in_document[~from_walk]]
        rows[from_walk] = np.array(walked_rows, dtype=np.int64).reshape(-1, 3)
        return rows
