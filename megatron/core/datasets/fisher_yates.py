"""The permutation made by C++'s Fisher-Yates loop, computed a block of steps at a time in numpy.

Megatron's `helpers.cpp` shuffles its sample mappings with

    for (i = n - 1; i > 0; --i) { j = rand64() % (i + 1); swap(row[i], row[j]); }

A direct port is a Python loop over n swaps (about 0.3 us each). Here the swaps are applied a block of
consecutive steps at a time, with whole-array operations, giving exactly the same permutation.

Within a block of steps (run from its highest step i down to its lowest), write `held[i]` for the value
sitting at position i just before step i. Step i finalises position i (it receives the value at j_i)
and, when j_i < i, moves `held[i]` down to position j_i. Hence:

* `held[i]` = `held[w]` for the smallest step w > i of the block that wrote to position i (the last
  write before step i), or the value at i when the block started; following the "smallest writer"
  links to the end of the chain (pointer doubling) resolves every `held` at once.
* the final value of position i is `held[i]` when j_i = i; otherwise it is what position j_i holds
  before step i: `held[w']` for the next writer w' > i of position j_i within the block, or the value
  at j_i when the block started.
* a position p below the block ends the block holding `held[w]` of its smallest writer w.

Grouping the writes by position (a stable argsort) gives the "next writer" links. Cost: O(n log b)
for blocks of b steps, with O(n + b) memory.
"""

import numpy as np

from megatron.core.datasets.mersenne_twister import MT19937_64

_BLOCK_STEPS = 1 << 20


def fisher_yates_order(num_items: int, generator: MT19937_64, block_steps: int = _BLOCK_STEPS) -> np.ndarray:
    """`order` (int64 [num_items]) such that `items[order]` is `items` after the C++ loop above, with
    `rand64()` the next raw output of `generator`."""
    values = np.arange(num_items, dtype=np.int64)
    high = num_items
    while high > 1:
        low = max(1, high - block_steps)
        steps = np.arange(low, high, dtype=np.int64)
        draws = generator.random_raw(high - low)[::-1]  # the loop draws for step high-1 first
        targets = (draws % (steps + 1).astype(np.uint64)).astype(np.int64)  # j_i in [0, i]
        _apply_block(values, low, targets)
        high = low
    return values


def _apply_block(values: np.ndarray, low: int, targets: np.ndarray) -> None:
    """Applies steps `low + k` (k = 0..b-1, run from high to low) with `j = targets[k]` to `values`."""
    count = len(targets)
    local = np.arange(count, dtype=np.int64)
    moves = targets != low + local  # steps that send their held value down to a lower position
    writer = local[moves]
    written = targets[moves]
    by_position = np.argsort(written, kind="stable")  # writers of one position stay in ascending order
    writer, written = writer[by_position], written[by_position]
    first_of_position = np.ones(len(written), dtype=bool)
    first_of_position[1:] = written[1:] != written[:-1]

    next_writer = np.full(count, -1, dtype=np.int64)  # next (larger) writer of the same position
    same_position = ~first_of_position[1:]
    next_writer[writer[:-1][same_position]] = writer[1:][same_position]

    smallest_writer_position = written[first_of_position]
    smallest_writer = writer[first_of_position]
    inside = smallest_writer_position >= low

    # held[k] = value at the end of the chain k -> smallest writer of position low + k -> ...
    chain = local.copy()
    chain[smallest_writer_position[inside] - low] = smallest_writer[inside]
    while True:
        jumped = chain[chain]
        if np.array_equal(jumped, chain):
            break
        chain = jumped
    held = values[low + chain]

    final = held.copy()
    movers = local[moves]
    after = next_writer[movers]
    final[movers] = np.where(after >= 0, held[np.maximum(after, 0)], values[targets[movers]])

    below = ~inside
    values[smallest_writer_position[below]] = held[smallest_writer[below]]
    values[low : low + count] = final
