"""Benchmark of the dataset index builders, up to the GPT sample index of 10^9 tokens.

    python tools/bench/dataset_index.py            # 10^9 tokens, blends up to 10^8 samples
    python tools/bench/dataset_index.py --quick    # 10^8 tokens, blends up to 10^7 samples

Prints one table: `build_sample_idx` alone and the whole GPT index build (document-index shuffle,
sample index, shuffle index, as `GPTDataset` runs it) for 10^9 tokens in documents of two length
distributions and two sequence lengths, then the blending indices for several sizes and dataset counts.
Synthetic inputs, no files; the numbers are wall-clock seconds of one run.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.core.datasets.blending_greedy import greedy_blend  # noqa: E402
from megatron.core.datasets.gpt_indices import build_gpt_indices  # noqa: E402
from megatron.core.datasets.helpers import build_sample_idx  # noqa: E402


def document_lengths(total_tokens: int, mean_length: int, seed: int = 0) -> np.ndarray:
    """int32 lengths uniform in [1, 2 * mean_length) adding up to at least `total_tokens`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * mean_length, size=int(total_tokens / mean_length * 1.05) + 1, dtype=np.int32)
    cut = int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), total_tokens)) + 1
    return lengths[:cut]


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def bench_sample_index(total_tokens: int) -> list[str]:
    rows = []
    for mean_length in (2048, 256):
        sizes = document_lengths(total_tokens, mean_length)
        tokens = int(sizes.sum(dtype=np.int64))
        documents = np.arange(len(sizes), dtype=np.int32)
        shuffled = documents.copy()
        np.random.RandomState(0).shuffle(shuffled)
        for sequence_length in (2048, 8192):
            seconds, sample_index = timed(build_sample_idx, sizes, shuffled, sequence_length, 1, tokens)
            full_seconds, _ = timed(build_gpt_indices, sizes, documents, None, sequence_length, 1234, True, True)
            rows.append(
                f"| {tokens / 1e9:.2f}e9 | {len(sizes):>9,} docs of ~{mean_length} | {sequence_length} | "
                f"{len(sample_index) - 1:>9,} | {seconds:6.2f} | {full_seconds:6.2f} |"
            )
    return rows


def bench_blending(sizes_and_counts: list[tuple[int, int]]) -> list[str]:
    rows = []
    rng = np.random.default_rng(0)
    for size, num_datasets in sizes_and_counts:
        weights = rng.random(num_datasets) + 0.1
        weights /= weights.sum()
        seconds, _ = timed(greedy_blend, weights, None, size)
        rows.append(f"| {size:>11,} | {num_datasets:>5} | {seconds:7.2f} | {seconds / size * 1e9:7.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x smaller problems")
    args = parser.parse_args()
    scale = 10 if args.quick else 1

    print("GPT sample index (seconds)")
    print("| tokens | documents | seq | samples | build_sample_idx | whole index build |")
    print("|---|---|---|---|---|---|")
    for row in bench_sample_index(10**9 // scale):
        print(row)

    print("\nBlending indices (seconds, ns per sample)")
    print("| samples | datasets | seconds | ns/sample |")
    print("|---|---|---|---|")
    cases = [(10**6, 2), (10**6, 10), (10**6, 100), (10**6, 1000), (10**7, 3), (10**7, 30), (10**8, 3)]
    for row in bench_blending([(size // scale, count) for size, count in cases]):
        print(row)


if __name__ == "__main__":
    main()
