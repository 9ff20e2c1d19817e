"""Vocabulary rows: the model's `padded_vocab_size` rows versus the tokenizer's `vocab_size` ids.

Megatron pads the embedding and output tables up to a multiple of make_vocab_size_divisible_by x TP
(reference 12 item 11). The extra rows are never a target, so an export trims them and a reshard to a
new TP size pads or trims to the new multiple. New rows copy the last existing row, as Megatron's savers
do (`orig_word_embed[-1].expand(...)`): their logits then equal a real token's, never exceed it.
"""

import torch


def resize_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` [V, ...] with exactly `rows` rows: trimmed, or padded by repeating its last row."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    padding = tensor[-1:].expand(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, padding], dim=0)


def trim_to_tokenizer(tensor: torch.Tensor, vocab_size: int | None, name: str) -> torch.Tensor:
    """The first `vocab_size` rows of a vocabulary tensor (the rest are padding), for an export; None (the
    tokenizer's size unknown) is refused."""
    if vocab_size is None:
        raise ValueError("the export needs the tokenizer's vocabulary size: give --true-vocab-size or keep the "
                         "tokenizer files the checkpoint's arguments name")
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"{name} has {tensor.shape[0]} vocabulary rows, fewer than the tokenizer's {vocab_size} "
                         "ids: the tokenizer (or --true-vocab-size) does not belong to this checkpoint")
    return tensor[:vocab_size]
