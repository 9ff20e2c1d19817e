"""All-gather context parallelism (`cp_comm_type="all_gather"`): every rank gathers the whole sequence's
keys and values and attends with its own queries.

The gather runs along the sequence over the CP group (`gather_from_sequence_parallel_region` with the CP
group: its backward reduce-scatters, so each rank receives the sum over all ranks' queries of the gradient
of its own keys/values). Rank j contributes chunks j and 2c-1-j (batch_split.py), so the gathered
sequence is reordered into chunk order 0 .. 2c-1 before use. Under a causal mask, query chunk q (n rows)
then needs keys [0, (q+1) n) with the causal offset q*n: row i sees keys 0 .. q*n + i.
"""

import torch

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.context_parallel.batch_split import chunks_of_cp_rank
from megatron.core.transformer.context_parallel.block_attention import BlockAttention, grouped_keys, grouped_queries


def _gathered_in_sequence_order(local: torch.Tensor, group, cp_size: int) -> torch.Tensor:
    """[2n, ...] local chunks -> [2c * n, ...] the whole sequence, in order."""
    gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=group)
    n = local.size(0) // 2
    held = [chunk for rank in range(cp_size) for chunk in chunks_of_cp_rank(rank, cp_size)]  # gathered order
    order = torch.tensor([held.index(chunk) for chunk in range(2 * cp_size)], device=local.device)
    return gathered.view(2 * cp_size, n, *local.shape[1:]).index_select(0, order).view(-1, *local.shape[1:])


def all_gather_attention(
    query, key, value, scale: float, causal: bool, group, cp_rank: int, cp_size: int,
    dropout_p: float = 0.0, seed: int | None = None, use_cudnn: bool = True,
):
    """query [2n, b, np, d], key/value [2n, b, ng, d] (this rank's chunks) -> O [b, ng, np/ng, 2n, d].
    Attention dropout with probability `dropout_p` draws its masks from `seed` (and `seed` + 1);
    `use_cudnn=False` keeps cuDNN's kernel out (block_attention.py)."""
    q = grouped_queries(query, key.size(2))
    k = grouped_keys(_gathered_in_sequence_order(key, group, cp_size))
    v = grouped_keys(_gathered_in_sequence_order(value, group, cp_size))
    if not causal:
        return BlockAttention.apply(q, k, v, scale, None, dropout_p, seed, use_cudnn)
    n = query.size(0) // 2
    outputs = []
    for half, (rows, chunk) in enumerate(zip((slice(0, n), slice(n, 2 * n)), chunks_of_cp_rank(cp_rank, cp_size))):
        keys = slice(0, (chunk + 1) * n)
        outputs.append(BlockAttention.apply(
            q[..., rows, :], k[..., keys, :], v[..., keys, :], scale, chunk * n, dropout_p,
            None if seed is None else seed + half, use_cudnn,
        ))
    return torch.cat(outputs, dim=-2)
