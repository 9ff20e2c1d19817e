"""Does the data fit the model? Token ids at or above the tokenizer's vocabulary size mean the data was
tokenized with another tokenizer: ids past the padded vocabulary crash the embedding lookup with an opaque
index error, ids in the padding rows train silently on garbage. Checked once, before training starts.

Only the first SCANNED_TOKENS tokens of each dataset are read (a few MB), and only where the file's dtype
can hold an id that large at all, so the check costs nothing on large blends.
"""

import numpy as np
import torch.distributed as dist

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path
from megatron.training.datasets.blend import get_blend_and_blend_per_split

SCANNED_TOKENS = 1 << 20


def _prefixes(args) -> list:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    blends = [blend] if blend is not None else [split for split in blend_per_split or [] if split is not None]
    return list(dict.fromkeys(prefix for prefixes, _ in blends for prefix in prefixes))


def find_vocabulary_mismatch(args, vocab_size: int) -> str | None:
    """A message naming the first dataset holding a token id >= `vocab_size`, or None."""
    if args.mock_data:
        return None
    for prefix in _prefixes(args):
        dataset = IndexedDataset(prefix)
        if np.iinfo(dataset.index.dtype).max < vocab_size or dataset.index.total_bytes == 0:
            continue
        tokens = np.memmap(get_bin_path(prefix), dtype=dataset.index.dtype, mode="r")[:SCANNED_TOKENS]
        largest = int(tokens.max())
        if largest >= vocab_size:
            return (
                f"dataset {prefix} holds token id {largest}, but the tokenizer ({args.tokenizer_type}) has "
                f"{vocab_size} ids: the data was tokenized with another tokenizer. Pass the tokenizer files it "
                "was made with, or re-run tools/preprocess_data.py with this run's tokenizer"
            )
    return None


def check_data_vocabulary(args, vocab_size: int) -> None:
    """Raises ValueError on every rank when rank 0 finds a dataset that does not fit the vocabulary."""
    verdict = [find_vocabulary_mismatch(args, vocab_size) if not dist.is_initialized() or dist.get_rank() == 0
               else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
