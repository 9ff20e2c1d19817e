"""The train/valid/test split of one low-level dataset: `--split "969,30,1"` -> index ranges.

`parse_and_normalize_split("969, 30, 1")` -> `[0.969, 0.03, 0.001]` (numbers found by the regex
`[.0-9]+`, so `99,1,0`, `98/2/0` and `969, 30, 1` all parse; missing entries are 0), then
`convert_split_vector_to_split_matrix` -> book-ends `[(0, 0.969), (0.969, 0.999), (0.999, 1.0)]`, None
for an empty split. A split gets the elements `[round(begin * N), round(end * N))` of a low-level
dataset with N elements (sequences for GPT, documents for BERT/T5).
"""

import re
from enum import Enum

from megatron.core.datasets.blend import normalize


class Split(Enum):
    """The three splits, in Megatron's order (their values index `sizes` and `split_matrix`)."""

    train = 0
    valid = 1
    test = 2


def parse_and_normalize_split(split: str) -> list[float]:
    """`"99,1,0"` -> `[0.99, 0.01, 0.0]`: the ratios of the train, valid and test splits."""
    ratios = [float(number) for number in re.findall(r"[.0-9]+", split)]
    problem = None
    if not ratios or len(ratios) > len(Split):
        problem = f"it has {len(ratios)} numbers"
    elif sum(ratios) <= 0:
        problem = "its ratios add up to 0"
    if problem is not None:
        raise ValueError(
            f"split {split!r} is not valid: {problem}; give 1 to 3 non-negative ratios for train, valid "
            f"and test, e.g. '969,30,1' or '98,2,0'"
        )
    ratios += [0.0] * (len(Split) - len(ratios))
    return normalize(ratios)


def convert_split_vector_to_split_matrix(
    vector_a: list[float], vector_b: list[float] | None = None
) -> list[tuple[float, float] | None]:
    """Book-ends of each split, the overlap of those of `vector_a` and (optionally) `vector_b`.

    `[0.99, 0.01, 0.0]` -> `[(0, 0.99), (0.99, 1.0), None]`. The running sums start from the integer 0
    and are built by repeated addition exactly as in Megatron-LM, because the matrix is part of the
    JSON description whose md5 names the index cache files.
    """
    if vector_b is None:
        vector_b = vector_a
    expansion_a, expansion_b = [0], [0]
    for ratio_a, ratio_b in zip(vector_a, vector_b):
        expansion_a.append(expansion_a[-1] + ratio_a)
        expansion_b.append(expansion_b[-1] + ratio_b)
    matrix = []
    for begin_a, end_a, begin_b, end_b in zip(expansion_a[:-1], expansion_a[1:], expansion_b[:-1], expansion_b[1:]):
        if min(end_a, end_b) <= max(begin_a, begin_b):
            matrix.append(None)
        else:
            matrix.append((max(begin_a, begin_b), min(end_a, end_b)))
    return matrix


def split_ranges(split_matrix: list[tuple[float, float] | None], num_elements: int) -> list[tuple[int, int] | None]:
    """The elements `[round(begin * N), round(end * N))` each split gets of a low-level dataset with
    `num_elements` = N elements (None for a split with no share)."""
    return [
        None if bounds is None
        else (int(round(bounds[0] * float(num_elements))), int(round(bounds[1] * float(num_elements))))
        for bounds in split_matrix
    ]
