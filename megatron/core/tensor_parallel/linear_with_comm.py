"""The autograd Functions of the tensor-parallel linears at TP > 1: each GEMM with its collective.

Activations are sequence-first; AG_s / RS_s all-gather / reduce-scatter the sequence over the p TP ranks
and AR all-reduces. A is this rank's weight shard in the nn.Linear layout.

ColumnParallelLinear, A [n/p, k]:
    with sequence parallelism, X [s/p, b, k]:
        forward    Y = AG_s(X) A^T + b                          [s, b, n/p]
        backward   dX = RS_s(dY A)                              [s/p, b, k]
                   dA = dY^T AG_s(X),  db = sum of dY over tokens
        Only X's shard is saved; AG_s(X) is gathered again in backward, started before dX's GEMM and
        running during it, while RS_s(dY A) runs during dA's GEMM (Megatron's order). This keeps the
        sequence-parallel saving: s/p rows per rank instead of s.
    without, X [s, b, k]: Y = X A^T + b; dX = AR(dY A), the all-reduce running during dA's GEMM.
RowParallelLinear with sequence parallelism, A [n, k/p], X [s, b, k/p]:
        forward    Y = RS_s(X A^T)                              [s/p, b, n]  (the layer adds its bias once)
        backward   G = AG_s(dY),  dX = G A,  dA = G^T X

With `overlap` (--tp-comm-overlap) the sequence collectives are fused with the GEMMs next to them
(comm_overlap.py): the forward AG_s + GEMM and GEMM + RS_s, the backward GEMM + RS_s of the column
layer's dX and AG_s + GEMM of the row layer's dX. The results are those of the plain order: the same
products and, for p = 2, the same sums.

With `accumulate` (gradient-accumulation fusion), dA and db are added straight into the `main_grad` (fp32 or bf16) of
the weight and bias, which are marked `grad_added_to_main_grad` (the protocol of fusions/fused_weight_gradient.py).
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_weight_gradient import add_bias_gradient, add_weight_gradient
from megatron.core.tensor_parallel.comm_overlap import (
    all_gather_matmul,
    matmul_reduce_scatter,
    rows,
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
)


def _weight_gradient(weight: torch.Tensor, grad_output: torch.Tensor, input_: torch.Tensor, accumulate: bool):
    """dA = dY^T X over all tokens: [n, k]; or added into main_grad, with a never-read placeholder returned."""
    if not accumulate:
        return rows(grad_output).t().mm(rows(input_))
    add_weight_gradient(weight, rows(grad_output), rows(input_))
    return torch.empty_like(weight)


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, weight, bias, group, rank, world_size, sequence_parallel, overlap, accumulate):
        ctx.save_for_backward(input_)
        # The parameter itself, not a saved copy: activation recomputation hands back recomputed saved
        # tensors, which lack main_grad.
        ctx.weight, ctx.bias = weight, bias
        ctx.communication = group, rank, world_size, sequence_parallel, overlap, accumulate
        if not sequence_parallel:
            return F.linear(input_, weight, bias)
        if overlap:
            return all_gather_matmul(input_, weight, bias, group, rank, world_size, keep_gathered=False)[1]
        return F.linear(start_all_gather(input_, group, world_size).wait(), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (input_,), weight = ctx.saved_tensors, ctx.weight
        group, rank, world_size, sequence_parallel, overlap, accumulate = ctx.communication
        grad_output = grad_output.contiguous()
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        gathering = start_all_gather(input_, group, world_size) if sequence_parallel and need_weight else None
        grad_input = None
        if need_input and sequence_parallel and overlap:
            grad_input = matmul_reduce_scatter(grad_output, weight.t(), group, rank, world_size)
        elif need_input and sequence_parallel:
            grad_input = start_reduce_scatter(grad_output.matmul(weight), group, world_size)
        elif need_input:
            grad_input = start_all_reduce(grad_output.matmul(weight), group)
        grad_weight = None
        if need_weight:
            total_input = gathering.wait() if gathering is not None else input_
            grad_weight = _weight_gradient(weight, grad_output, total_input, accumulate)
        grad_bias = None
        if ctx.bias is not None and need_bias:
            grad_bias = add_bias_gradient(ctx.bias, rows(grad_output), accumulate)
        grad_input = grad_input.wait() if grad_input is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class _RowParallelLinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, weight, group, rank, world_size, overlap, accumulate):
        ctx.save_for_backward(input_)
        ctx.weight = weight
        ctx.communication = group, rank, world_size, overlap, accumulate
        if overlap:
            return matmul_reduce_scatter(input_, weight, group, rank, world_size).wait()
        return start_reduce_scatter(F.linear(input_, weight), group, world_size).wait()

    @staticmethod
    def backward(ctx, grad_output):
        (input_,), weight = ctx.saved_tensors, ctx.weight
        group, rank, world_size, overlap, accumulate = ctx.communication
        grad_output = grad_output.contiguous()
        if overlap and ctx.needs_input_grad[0]:
            total_grad, grad_input = all_gather_matmul(
                grad_output, weight.t(), None, group, rank, world_size, keep_gathered=True
            )
        else:
            total_grad = start_all_gather(grad_output, group, world_size).wait()
            grad_input = total_grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = _weight_gradient(weight, total_grad, input_, accumulate) if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None, None, None, None, None


def column_parallel_linear(input_, weight, bias, group, rank, world_size, sequence_parallel, overlap, accumulate):
    """Y = AG_s(X) A^T + b with sequence parallelism, else X A^T + b with dX all-reduced (see above)."""
    return _ColumnParallelLinear.apply(
        input_, weight, bias, group, rank, world_size, sequence_parallel, overlap, accumulate
    )


def row_parallel_linear_reduce_scatter(input_, weight, group, rank, world_size, overlap, accumulate):
    """Y = RS_s(X A^T), the sequence-parallel row-parallel GEMM without bias (see above)."""
    return _RowParallelLinearReduceScatter.apply(input_, weight, group, rank, world_size, overlap, accumulate)
