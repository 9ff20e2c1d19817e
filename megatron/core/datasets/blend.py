"""A blend: dataset prefixes with optional weights, as `--data-path [w1] p1 [w2] p2 ...` gives them."""

import numpy as np

Blend = tuple[list[str], list[float] | None]


def normalize(weights: list[float]) -> list[float]:
    """Weights divided by their sum, in float64 as Megatron-LM does (the values enter cache hashes)."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def get_blend_from_list(blend: list[str] | None) -> Blend | None:
    """`["30", "a", "70", "b"]` -> `(["a", "b"], [30.0, 70.0])`; `["a", "b"]` -> `(["a", "b"], None)`.

    The list is weighted when it has an even length and every entry at an even position parses as a
    number; otherwise every entry is a prefix. Weights are relative sampling rates (normalised later),
    not sample counts, and must be positive.
    """
    if blend is None:
        return None
    weights = None
    if len(blend) % 2 == 0:
        try:
            weights = [float(entry) for entry in blend[0::2]]
        except ValueError:
            weights = None
    if weights is None:
        return [prefix.strip() for prefix in blend], None
    non_positive = [(weight, prefix) for weight, prefix in zip(weights, blend[1::2]) if not weight > 0]
    if non_positive:
        raise ValueError(
            f"blend weights must be positive, got {non_positive[0][0]} for {non_positive[0][1]!r}; "
            f"write --data-path as 'w1 prefix1 w2 prefix2 ...' with w > 0, or prefixes only"
        )
    return [prefix.strip() for prefix in blend[1::2]], weights
