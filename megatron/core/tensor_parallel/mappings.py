"""Autograd-aware collectives that move activations into and out of tensor-parallel regions.

Each mapping is a pair (forward op, backward op) whose backward is the adjoint of its forward:

    copy_to_tensor_model_parallel_region            identity               / all-reduce
    reduce_from_tensor_model_parallel_region        all-reduce             / identity
    scatter_to_tensor_model_parallel_region         keep my last-dim slice / all-gather last dim
    gather_from_tensor_model_parallel_region        all-gather last dim    / keep my slice
    all_gather_last_dim_from_tensor_parallel_region all-gather last dim    / reduce-scatter last dim
    scatter_to_sequence_parallel_region             keep my first-dim slice/ all-gather first dim
    gather_from_sequence_parallel_region            all-gather first dim   / reduce-scatter first dim
    reduce_scatter_to_sequence_parallel_region      reduce-scatter first   / all-gather first dim

Activations are sequence-first [s, b, h], so "first dim" is the sequence. Every mapping is the
identity when the TP group has one rank. Last-dim splits may be uneven (see `partition.py`); sequence
splits must be even.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.partition import partition_range

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tp_group_and_size(group):
    if group is None:
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return None, 1
        group = parallel_state.get_tensor_model_parallel_group()
    return group, dist.get_world_size(group)


def _reduce(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the TP ranks, in place on a contiguous copy of the input."""
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    dist.all_reduce(input_, group=group)
    return input_


def _split_along_last_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    start, end = partition_range(input_.size(-1), dist.get_rank(group), world_size)
    return input_[..., start:end].contiguous()


def _gather_along_last_dim(input_: torch.Tensor, full_size: int | None = None, group=None) -> torch.Tensor:
    """Concatenates the ranks' last-dim shards. `full_size` allows the uneven split of `partition.py`:
    shards are padded to ceil(full_size / p), gathered, and the padding trimmed off the end."""
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    local = input_.size(-1)
    chunk = local if full_size is None else -(-full_size // world_size)
    if local < chunk:
        input_ = torch.nn.functional.pad(input_, (0, chunk - local))
    # The collective concatenates flat buffers: [p * numel] -> [p, ..., chunk] -> [..., p, chunk].
    gathered = torch.empty(world_size * input_.numel(), dtype=input_.dtype, device=input_.device)
    all_gather_single(gathered, input_.contiguous().view(-1), group=group)
    gathered = gathered.view((world_size,) + input_.shape)
    output = gathered.movedim(0, -2).reshape(input_.shape[:-1] + (world_size * chunk,))
    return output if full_size is None else output[..., :full_size].contiguous()


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Sums over the TP ranks and keeps this rank's (even) slice of the last dim."""
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    if input_.size(-1) % world_size:
        raise ValueError(f"cannot reduce-scatter a last dim of {input_.size(-1)} over {world_size} TP ranks evenly")
    chunk = input_.size(-1) // world_size
    # The collective splits a flat buffer into p pieces: [..., p * chunk] -> [p, ..., chunk].
    stacked = input_.reshape(input_.shape[:-1] + (world_size, chunk)).movedim(-2, 0).contiguous()
    output = torch.empty(input_.shape[:-1] + (chunk,), dtype=input_.dtype, device=input_.device)
    reduce_scatter_single(output.view(-1), stacked.view(-1), group=group)
    return output


def check_sequence_split(input_: torch.Tensor, world_size: int) -> None:
    """Raises unless the sequence (dim 0) of `input_` splits evenly over `world_size` TP ranks."""
    if input_.size(0) % world_size:
        raise ValueError(
            f"sequence parallelism splits the sequence over {world_size} TP ranks, but the sequence length "
            f"is {input_.size(0)}; use a sequence length divisible by tensor_model_parallel_size"
        )


def _split_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    check_sequence_split(input_, world_size)
    local = input_.size(0) // world_size
    rank = dist.get_rank(group)
    return input_[rank * local : (rank + 1) * local].contiguous()


def _gather_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    output = torch.empty((world_size * input_.size(0),) + input_.shape[1:], dtype=input_.dtype, device=input_.device)
    all_gather_single(output, input_.contiguous(), group=group)
    return output


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group=None) -> torch.Tensor:
    group, world_size = _tp_group_and_size(group)
    if world_size == 1:
        return input_
    check_sequence_split(input_, world_size)
    output = torch.empty(
        (input_.size(0) // world_size,) + input_.shape[1:], dtype=input_.dtype, device=input_.device
    )
    reduce_scatter_single(output, input_.contiguous(), group=group)
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group, ctx.full_size = group, input_.size(-1)
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.full_size, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, full_size, group):
        ctx.group = group
        return _gather_along_last_dim(input_, full_size, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, None, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        # When the gathered tensor feeds a TP-split computation, each rank's gradient is a partial sum
        # over the TP ranks: reduce-scatter it. Otherwise every rank already has the full gradient.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_first_dim(grad_output, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Identity forward; all-reduce of the gradient (input of a column-parallel layer)."""
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """All-reduce forward (output of a row-parallel layer); identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Keep this rank's slice of the last dim; all-gather the gradient."""
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_, full_size: int | None = None, group=None):
    """All-gather the last dim (to `full_size` when the split is uneven); slice the gradient."""
    return _GatherFromModelParallelRegion.apply(input_, full_size, group)


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """All-gather the last dim; reduce-scatter the gradient. Unlike `gather_from_tensor_model_parallel_region`,
    for when every rank goes on to use (part of) the other ranks' shards, so their gradients add up."""
    return _AllGatherFromTensorParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_, group=None):
    """Keep this rank's slice of the sequence; all-gather the gradient."""
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad: bool = True, group=None):
    """All-gather the sequence; reduce-scatter (or just slice) the gradient."""
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad, group)


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    """Sum over the TP ranks and keep this rank's slice of the sequence; all-gather the gradient."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)
