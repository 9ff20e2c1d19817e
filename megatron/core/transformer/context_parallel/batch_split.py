"""The load-balanced split of the sequence over the context-parallel ranks (Megatron's
`get_batch_on_this_cp_rank` and `get_pos_emb_on_this_cp_rank`).

Under a causal mask a token attends to all the tokens before it, so a plain split into c contiguous
pieces would give the last rank c times the attention work of the first. Instead the sequence is cut
into 2c equal chunks and CP rank r keeps chunks r and 2c-1-r, one early and one late:

    CP=2, s=8:  chunks 0..3 of 2 tokens   rank 0 -> tokens 0 1 6 7    rank 1 -> tokens 2 3 4 5

Every tensor that carries a sequence dimension is split the same way (tokens, labels, loss mask, position
ids, the rotary angles), so each rank computes the losses of exactly its own tokens.
"""

import torch

from megatron.core import parallel_state


def chunks_of_cp_rank(cp_rank: int, cp_size: int) -> list[int]:
    """The two of the 2*cp_size sequence chunks that `cp_rank` holds, in sequence order."""
    return [cp_rank, 2 * cp_size - 1 - cp_rank]


def _this_rank_chunks(tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """[..., s, ...] -> [..., 2 * s/(2c), ...]: chunks r and 2c-1-r of dimension `seq_dim`."""
    length = tensor.size(seq_dim)
    if length % (2 * cp_size):
        raise ValueError(
            f"context parallelism splits the sequence into 2 x CP = {2 * cp_size} equal chunks, but the "
            f"sequence length is {length}; use a sequence length divisible by {2 * cp_size}"
        )
    # [..., s, ...] -> [..., 2c, s/2c, ...], keep two chunks, -> [..., s/c, ...]
    chunked = tensor.view(*tensor.shape[:seq_dim], 2 * cp_size, length // (2 * cp_size), *tensor.shape[seq_dim + 1 :])
    index = torch.tensor(chunks_of_cp_rank(cp_rank, cp_size), device=tensor.device)
    selected = chunked.index_select(seq_dim, index)
    return selected.view(*tensor.shape[:seq_dim], -1, *tensor.shape[seq_dim + 1 :])


def get_batch_on_this_cp_rank(batch: dict) -> dict:
    """Keeps this CP rank's two chunks of every tensor of `batch` (in place; also returned).

    The sequence is dimension 1 ([b, s]) except for `attention_mask` [b, 1, s, s], whose query dimension 2
    is split (each rank's queries still see every key). None values stay None. A no-op without CP.
    """
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return batch
    cp_rank = parallel_state.get_context_parallel_rank()
    for key, value in batch.items():
        if value is not None:
            batch[key] = _this_rank_chunks(value, 2 if key == "attention_mask" else 1, cp_rank, cp_size)
    return batch


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """The rows of position embeddings (e.g. rotary angles [s, 1, 1, d]) at this CP rank's positions."""
    return _this_rank_chunks(
        pos_emb, seq_dim, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()
    )
