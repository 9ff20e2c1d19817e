"""Megatron's greedy blending rule, run for many stretches of samples side by side.

The rule (helpers.cpp `build_blending_indices`): sample i goes to the dataset with the largest error

    error[d] = weights[d] * max(i, 1) - count[d]            (float64, first index wins ties)

where count[d] is how many earlier samples went to d; the exhaustive variant only considers datasets
whose count is below their size. Each choice depends on all earlier ones, so a direct port is a Python
loop over samples (~1 us each). We instead cut the samples into P chunks and simulate all chunks in
lockstep, a few numpy operations per step covering every chunk:

1. Guess each chunk's starting counts: round `weights * start` to integers summing to `start`, then
   run the rule for a warm-up stretch before the chunk. The rule pulls every count back towards
   `weights * i`, so runs from different counts merge after a few steps (a few hundred at most in our
   measurements, usually one); after the warm-up the guess almost always equals the true counts.
2. Simulate every chunk from its guessed counts, recording choices and counts.
3. Verify: chunk k is right iff its starting counts equal the final counts of chunk k-1 (chunk 0 starts
   from zeros, so it is right). Re-simulate the wrong chunks from their predecessors' final counts
   until they merge with their previous run, and repeat until nothing changes. Each round fixes at
   least the first wrong chunk, so this terminates, and the result is the sequential greedy exactly:
   errors are computed with the same float64 operations as the C++ loop (a multiply, then a subtract).

Speed (`tools/bench/dataset_index.py`, one CPU core's numpy): about 30 ns per sample with 3 datasets
(10^8 samples in 3 s), 180 ns with 30, 2.5 us with 1000. The work grows with samples x datasets as in
the C++ loop; a -O3 C build of that loop ran 1.3-4x faster than this on the same machine.
"""

import numpy as np

_CHUNK_CELLS = 1 << 16  # chunks x datasets per step: keeps the [P, D] working arrays in cache
_MIN_CHUNK_LENGTH = 64
_MAX_WARMUP_STEPS = 512
_BLOCK_STEPS = 64  # steps buffered before they are written, transposed, into the chunk-major output


def _guess_counts(weights: np.ndarray, limits: np.ndarray | None, steps: np.ndarray) -> np.ndarray:
    """Counts `[P, D]` near the greedy's after `steps[p]` samples: largest-remainder rounding of
    `steps * weights`, capped at `limits`."""
    ideal = np.outer(steps.astype(np.float64), weights)
    counts = np.floor(ideal)
    remainder = steps - counts.sum(axis=1)
    order = np.argsort(counts - ideal, axis=1, kind="stable")  # largest fractional part first
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(len(weights))[None, :], axis=1)
    counts += ranks < remainder[:, None]
    if limits is not None:
        np.minimum(counts, limits[None, :], out=counts)
    return counts


class _Chooser:
    """The greedy choice for P chunks at once: `choose(position [P], counts [P, D]) -> dataset [P]`.

    With few datasets the errors are laid out `[D, P]` and reduced by a running maximum over D
    contiguous rows (strict `>`, so the first maximum wins); with many, `[P, D]` and `argmax(axis=1)`
    (numpy's argmax also returns the first maximum). Both compute `weights[d] * position - count` with
    the same two float64 roundings as the C++ loop.
    """

    _MAX_DATASETS_FOR_ROWS = 16  # measured crossover of the two layouts on a 2-core CPU

    def __init__(self, weights: np.ndarray, limits: np.ndarray | None, num_chunks: int):
        self.weights = weights
        self.limits = None if limits is None else limits.astype(np.float64)
        self.by_rows = len(weights) <= self._MAX_DATASETS_FOR_ROWS
        shape = (len(weights), num_chunks) if self.by_rows else (num_chunks, len(weights))
        self.error = np.empty(shape)
        self.best = np.empty(num_chunks, dtype=np.intp)

    def choose(self, position: np.ndarray, counts: np.ndarray) -> np.ndarray:
        error = self.error
        if not self.by_rows:
            np.multiply(position[:, None], self.weights[None, :], out=error)
            error -= counts
            if self.limits is not None:
                error[counts >= self.limits[None, :]] = -np.inf
            return error.argmax(axis=1)
        np.multiply(self.weights[:, None], position[None, :], out=error)
        error -= counts.T
        if self.limits is not None:
            error[counts.T >= self.limits[:, None]] = -np.inf
        best, best_error = self.best, error[0]
        best.fill(0)
        for dataset in range(1, len(self.weights)):
            np.copyto(best, dataset, where=error[dataset] > best_error)
            np.maximum(best_error, error[dataset], out=best_error)
        return best


def _run_lockstep(weights, limits, first_sample, counts, num_steps, on_block=None) -> None:
    """Advances `counts [P, D]` (float64, exact below 2**53) by up to `num_steps` choices per chunk,
    chunk p starting at sample `first_sample[p]`.

    `on_block(t0, chosen [B, P] int16, taken [B, P] int64)` receives the choices and the pre-choice
    count of the chosen dataset in blocks of steps; returning True stops the run after that block.
    """
    num_chunks, num_datasets = counts.shape
    chooser = _Chooser(weights, limits, num_chunks)
    flat_counts = counts.reshape(-1)
    row_start = np.arange(num_chunks) * num_datasets
    position = np.empty(num_chunks)
    chosen_block = np.empty((_BLOCK_STEPS, num_chunks), dtype=np.int16)
    taken_block = np.empty((_BLOCK_STEPS, num_chunks), dtype=np.int64)
    first = first_sample.astype(np.float64)
    for step in range(num_steps):
        np.add(first, step, out=position)
        if step == 0:
            np.maximum(position, 1.0, out=position)  # sample 0 uses max(0, 1) = 1
        chosen = chooser.choose(position, counts)
        flat_choice = row_start + chosen
        taken = flat_counts[flat_choice]
        flat_counts[flat_choice] = taken + 1.0
        row = step % _BLOCK_STEPS
        chosen_block[row] = chosen
        taken_block[row] = taken
        if on_block is not None and (row == _BLOCK_STEPS - 1 or step == num_steps - 1):
            if on_block(step - row, chosen_block[: row + 1], taken_block[: row + 1]):
                return


def greedy_blend(weights: np.ndarray, limits: np.ndarray | None, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(dataset_index int16 [size], dataset_sample_index int64 [size])` of the greedy rule.

    `limits` (the exhaustive variant) caps how many samples each dataset gives; `size` must then be
    `limits.sum()`.
    """
    num_datasets = len(weights)
    if size == 0:
        return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
    num_chunks = max(1, min(_CHUNK_CELLS // num_datasets, size // _MIN_CHUNK_LENGTH))
    chunk_length = -(-size // num_chunks)
    num_chunks = -(-size // chunk_length)
    warmup = min(chunk_length // 4, _MAX_WARMUP_STEPS)
    chunk_start = np.arange(num_chunks, dtype=np.int64) * chunk_length

    # Chunk-major outputs, one row per chunk; the last row is cut at `size` on return.
    dataset_index = np.empty((num_chunks, chunk_length), dtype=np.int16)
    dataset_sample_index = np.empty((num_chunks, chunk_length), dtype=np.int64)

    # 1. Guessed counts at each chunk start: warm up from a rounded guess `warmup` samples earlier.
    start_counts = np.zeros((num_chunks, num_datasets))
    if num_chunks > 1:
        warm_start = chunk_start[1:] - warmup
        warm_counts = _guess_counts(weights, limits, warm_start)
        _run_lockstep(weights, limits, warm_start, warm_counts, warmup)
        start_counts[1:] = warm_counts

    # 2. Every chunk from its guess.
    def write_all(t0, chosen, taken):
        dataset_index[:, t0 : t0 + len(chosen)] = chosen.T
        dataset_sample_index[:, t0 : t0 + len(taken)] = taken.T

    end_counts = start_counts.copy()
    _run_lockstep(weights, limits, chunk_start, end_counts, chunk_length, write_all)

    # 3. Re-run the chunks whose start disagrees with their predecessor's end, until each merges with
    # its previous run: `difference` tracks new minus old counts; once it is zero the old choices and
    # old end counts hold from there on.
    while True:
        wrong = np.flatnonzero((start_counts[1:] != end_counts[:-1]).any(axis=1)) + 1
        if len(wrong) == 0:
            break
        difference = end_counts[wrong - 1] - start_counts[wrong]
        flat_difference = difference.reshape(-1)
        row_start = np.arange(len(wrong)) * num_datasets
        start_counts[wrong] = end_counts[wrong - 1]
        counts = start_counts[wrong]

        def rewrite(t0, chosen, taken):
            old = dataset_index[wrong, t0 : t0 + len(chosen)].T
            np.add.at(flat_difference, (row_start + chosen).reshape(-1), 1.0)
            np.add.at(flat_difference, (row_start + old).reshape(-1), -1.0)
            dataset_index[wrong, t0 : t0 + len(chosen)] = chosen.T
            dataset_sample_index[wrong, t0 : t0 + len(taken)] = taken.T
            return not difference.any()

        _run_lockstep(weights, limits, chunk_start[wrong], counts, chunk_length, rewrite)
        unmerged = difference.any(axis=1)
        end_counts[wrong[unmerged]] = counts[unmerged]
    return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]
