"""The key/value cache of static-batch generation (Megatron-Core's `StaticInferenceContext`).

A batch of b sequences is generated together; at each forward pass the model sees the sq new tokens of
every sequence, at absolute positions `sequence_len_offset .. sequence_len_offset + sq - 1`. Each
attention layer appends their keys and values to its cache

    key_value_memory_dict[layer_number] = (keys, values), each [max_sequence_length, max_batch_size, ng/p, hn]

and attends over all sk = sequence_len_offset + sq cached positions, so earlier tokens are never
recomputed. The caller advances `sequence_len_offset` after each forward pass.
"""

import torch


class StaticInferenceContext:
    """Preallocated (lazily, at each layer's first call) key/value memory for `max_batch_size` sequences of
    up to `max_sequence_length` tokens, plus the current sequence offset.

    With `materialize_only_last_token_logits` (the default) `GPTModel` computes the logits of the last
    position only: generation needs nothing else, and the output layer is the largest matmul of a step.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, materialize_only_last_token_logits: bool = True):
        for name, value in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticInferenceContext: {name} must be a positive integer, got {value!r}")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def is_static_batching(self) -> bool:
        """Always True: every sequence of the batch advances by the same number of positions."""
        return True

    def increment_sequence_len_offset(self, increment: int) -> None:
        """Moves past the `increment` positions the last forward pass cached."""
        self.sequence_len_offset += increment

    def reset(self) -> None:
        """Starts a new batch; the memory is kept and overwritten."""
        self.sequence_len_offset = 0

    def append_key_value(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Caches key/value [sq, b, ng/p, hn] of the new positions; returns the keys and values of every
        position so far, [sequence_len_offset + sq, b, ng/p, hn] each."""
        new_positions, batch = key.shape[:2]
        end = self.sequence_len_offset + new_positions
        if end > self.max_sequence_length:
            raise ValueError(
                f"StaticInferenceContext: positions {self.sequence_len_offset}..{end - 1} do not fit the cache "
                f"of max_sequence_length {self.max_sequence_length}"
            )
        if batch > self.max_batch_size:
            raise ValueError(
                f"StaticInferenceContext: a batch of {batch} sequences does not fit the cache of "
                f"max_batch_size {self.max_batch_size}"
            )
        if layer_number not in self.key_value_memory_dict:
            rows = (self.max_sequence_length, self.max_batch_size)
            # Keys and values may differ in width (multi-latent attention).
            self.key_value_memory_dict[layer_number] = (
                torch.empty(rows + key.shape[2:], dtype=key.dtype, device=key.device),
                torch.empty(rows + value.shape[2:], dtype=value.dtype, device=value.device),
            )
        key_memory, value_memory = self.key_value_memory_dict[layer_number]
        key_memory[self.sequence_len_offset:end, :batch] = key
        value_memory[self.sequence_len_offset:end, :batch] = value
        return key_memory[:end, :batch], value_memory[:end, :batch]
