"""`BlendedMegatronDatasetConfig`: what every Megatron-Core dataset is built from (blend, split, seed,
sequence length, cache directory, tokenizer), checked once when it is constructed."""

import logging
from dataclasses import dataclass, field

from megatron.core.datasets.blend import Blend
from megatron.core.datasets.rank_logging import log_single_rank
from megatron.core.datasets.split import (  # noqa: F401  (Megatron-LM exports both from this module)
    Split,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

logger = logging.getLogger(__name__)


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration of Megatron-Core datasets (Megatron-LM's fields, names and defaults)."""

    random_seed: int
    """The seed of every random choice made while building the dataset indices (`--seed`)."""

    sequence_length: int
    """Tokens per sample (`--seq-length`)."""

    blend: Blend | None = None
    """`(prefixes, weights or None)` shared by all splits, e.g. `(["a", "b"], [0.3, 0.7])`; None weights
    mean "in proportion to the datasets' sizes". Exclusive with `blend_per_split`."""

    blend_per_split: list[Blend | None] | None = None
    """One blend (or None) per split: train, valid, test. Exclusive with `blend` and `split`."""

    split: str | None = None
    """Ratios of the train/valid/test splits of each dataset in `blend`, e.g. `"969,30,1"`."""

    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)
    """Book-ends of each split, derived from `split` (not a constructor argument)."""

    num_dataset_builder_threads: int = 1
    """Threads that build the mid-level datasets of a blend."""

    path_to_cache: str | None = None
    """Directory of the index cache files (`--data-cache-path`); None: next to each dataset."""

    mmap_bin_files: bool = True
    """Memory-map the `.bin` files (`--no-mmap-bin-files` turns it off)."""

    mock: bool = field(init=False, default=False)
    """True when neither `blend` nor `blend_per_split` is given: synthetic data (not an argument)."""

    tokenizer: object | None = None
    """Any object with `eod`, optionally `pad`, and `unique_identifiers` (hashed into cache names)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per blended dataset so the blend never runs short."""

    allow_ambiguous_pad_tokens: bool = False
    """Keep a pad id that equals another special token (eod/eos); by default such an id is replaced by
    -1 so that real eod tokens are never masked out as padding."""

    def __post_init__(self) -> None:
        problems = []
        if self.sequence_length is None or self.sequence_length < 2:
            problems.append(f"sequence_length must be at least 2, got {self.sequence_length}")
        if self.num_dataset_builder_threads < 1:
            problems.append(f"num_dataset_builder_threads must be at least 1, got {self.num_dataset_builder_threads}")
        if self.mid_level_dataset_surplus < 0:
            problems.append(f"mid_level_dataset_surplus must be >= 0, got {self.mid_level_dataset_surplus}")
        per_split = self.blend_per_split is not None and any(self.blend_per_split)
        if per_split:
            if self.blend is not None:
                problems.append("blend (--data-path) and blend_per_split (--train/valid/test-data-path) are exclusive")
            if self.split is not None:
                problems.append("split (--split) does not apply to blend_per_split (--train/valid/test-data-path)")
            if len(self.blend_per_split) != len(Split):
                problems.append(
                    f"blend_per_split needs {len(Split)} entries (train, valid, test), got {len(self.blend_per_split)}"
                )
            for split, blend in zip(Split, self.blend_per_split):
                problems += _blend_problems(blend, f"the {split.name} blend")
        elif self.blend is not None:
            problems += _blend_problems(self.blend, "blend")
            if self.split is None:
                problems.append("split (--split, e.g. '969,30,1') is required with blend (--data-path)")
        else:
            self.mock = True
            self.split = "1,1,1"
            log_single_rank(logger, logging.INFO, "No blend given: mock data, split = 1,1,1")
        if problems:
            raise ValueError(f"{type(self).__name__} is not valid:\n  " + "\n  ".join(problems))
        if not per_split:
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
            log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def _blend_problems(blend: Blend | None, name: str) -> list[str]:
    if blend is None:
        return []
    prefixes, weights = blend
    if not prefixes:
        return [f"{name} has no dataset prefixes"]
    if weights is not None and len(weights) != len(prefixes):
        return [f"{name} has {len(prefixes)} prefixes but {len(weights)} weights"]
    return []
