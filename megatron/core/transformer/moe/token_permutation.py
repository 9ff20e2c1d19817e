"""Reordering tokens by expert and back, plus the variable-size all-to-all that moves them between ranks.

    permute:   tokens [T, h], routing_map [T, E] -> rows grouped by expert, each group in token order:
               [expert 0: t, t', ...][expert 1: ...] ...   (N = routing_map.sum() rows)
    unpermute: the inverse with the routing weights: out[t] = sum over (e, t) rows of prob[t, e] * row,
               summed in fp32 in expert order, so that splitting the experts over ranks and summing the
               ranks' partial outputs gives the same numbers.
"""

import torch
import torch.distributed as dist


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """(permuted tokens [N, h], their routing weights [N], source token index [N], tokens per expert [E]).

    routing_map [T, E] bool and probs [T, E] cover the experts to dispatch to, in order.
    """
    expert_major_map = routing_map.T.contiguous()  # [E, T]
    token_indices = torch.arange(tokens.size(0), device=tokens.device).expand_as(expert_major_map)
    sorted_indices = token_indices.masked_select(expert_major_map)
    permuted_probs = probs.T.contiguous().masked_select(expert_major_map)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices, expert_major_map.sum(dim=1)


def unpermute(rows: torch.Tensor, permuted_probs: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int):
    """[N, h] expert outputs -> [num_tokens, h] fp32: each row scaled by its weight, added to its token."""
    weighted = rows.float() * permuted_probs.unsqueeze(-1)
    output = torch.zeros(num_tokens, rows.size(-1), dtype=torch.float32, device=rows.device)
    return output.index_add(0, sorted_indices, weighted)


class _AllToAll(torch.autograd.Function):
    """Rank r sends input rows [sum(input_splits), h] in chunks input_splits[j] to rank j of `group`
    and receives output_splits[j] rows from rank j; the backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, group, input_, output_splits: list, input_splits: list):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        output = input_.new_empty((sum(output_splits),) + tuple(input_.shape[1:]))
        dist.all_to_all_single(output, input_.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return None, _AllToAll.apply(ctx.group, grad_output, ctx.input_splits, ctx.output_splits), None, None


def all_to_all(group, input_: torch.Tensor, output_splits: list, input_splits: list) -> torch.Tensor:
    """Autograd-aware variable-size all-to-all along dim 0 (see `_AllToAll`)."""
    if dist.get_world_size(group) == 1:
        return input_
    return _AllToAll.apply(group, input_, output_splits, input_splits)


def sort_chunks_by_idxs(rows: torch.Tensor, split_sizes: list, sorted_idxs: list) -> torch.Tensor:
    """Splits `rows` into chunks of `split_sizes` and concatenates them in the order `sorted_idxs`."""
    chunks = torch.split(rows, split_sizes, dim=0)
    return torch.cat([chunks[index] for index in sorted_idxs], dim=0)
