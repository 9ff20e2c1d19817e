"""Memory-efficient cross entropy over tensor-parallel logits: no fp32 copy of the [s, b, V/p] logits.

The same function as `megatron.core.tensor_parallel.vocab_parallel_cross_entropy` (the reference; read
its docstring for the maths), computed from the logits in their own dtype (bf16) in row chunks:

    forward, per chunk of rows and this rank's V/p columns (fp32 inside the kernel only):
        m_r = max_j x_j,  e_r = sum_j exp(x_j - m_r),  x_t (target logit if this rank owns t),  sum_j x_j
    over the TP ranks:  M = max_r m_r,  lse = M + log(sum_r e_r exp(m_r - M))
        loss = lse - x_t                     (label smoothing a' = a V/(V-1):
        loss = (1 - a') (lse - x_t) - a' (sum_j x_j / V - lse))
    backward, per chunk, straight into a gradient of the logits' dtype:
        dL/dx_j = g * (exp(x_j - lse) - (1 - a') [j == t] - a'/V)

Only the logits (already in memory) and lse [s, b] are kept for the backward. On CUDA each chunk's
statistics and gradient are one generated kernel each (`cuda_fuser`). With `reuse_logits` the backward writes
the gradient over the logits, chunk by chunk (each element is read before it is written): for a caller whose
logits exist only for this loss (the models' own forward), the backward then allocates no second [s, b, V/p]
tensor, which otherwise sat beside the logits at the start of the backward, the step's peak (824 MB for
8192 tokens of a 50304-token vocabulary in bf16).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.cuda_fuser import cuda_fuser
from megatron.core.tensor_parallel.cross_entropy import vocab_start_and_size

_CHUNK_ELEMENTS = 2**27  # rows per chunk = this / (V/p): bounds eager (CPU) fp32 temporaries to 512 MB


@cuda_fuser
def _chunk_statistics(logits: torch.Tensor, local_target: torch.Tensor, row_sums: bool):
    """logits [n, V/p], local_target [n] (-1 where another rank owns the target) -> four fp32 [n]:
    row max, sum of exp(x - max), target logit (0 where not owned), row sum (zeros unless `row_sums`).

    The max and the sum of exponentials are written as Inductor's softmax pattern (amax and sum with keepdim)
    so that it computes both in one pass over the row (its online softmax), as it does for torch's own
    log_softmax; the other spelling read each row twice (0.56 ms a step of GPT-2 small's [8192, 50304] logits
    on an H100, twice the time its bytes take)."""
    x = logits.float()
    row_max = x.amax(dim=-1, keepdim=True)
    sum_exp = torch.exp(x - row_max).sum(dim=-1, keepdim=True)
    owned = local_target >= 0
    target_logit = x.gather(-1, local_target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    row_sum = x.sum(dim=-1) if row_sums else torch.zeros_like(target_logit)
    return row_max.squeeze(-1), sum_exp.squeeze(-1), torch.where(owned, target_logit, 0.0), row_sum


@cuda_fuser
def _chunk_gradient(
    logits: torch.Tensor, lse: torch.Tensor, local_target: torch.Tensor, grad_output: torch.Tensor,
    smoothing: float, vocab_size: int, out: torch.Tensor,
) -> None:
    """Writes dL/dlogits [n, V/p] into `out` (the logits' dtype; see the module docstring)."""
    softmax = torch.exp(logits.float() - lse.unsqueeze(-1))
    columns = torch.arange(logits.size(-1), device=logits.device)
    is_target = columns.unsqueeze(0) == local_target.unsqueeze(-1)
    grad = softmax - torch.where(is_target, 1.0 - smoothing, 0.0) - smoothing / vocab_size
    out.copy_(grad * grad_output.unsqueeze(-1))


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, reuse_logits):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
        local_vocab = vocab_parallel_logits.size(-1)
        logits = vocab_parallel_logits.reshape(-1, local_vocab)  # [n = s*b, V/p], a view
        vocab_start, vocab_size = vocab_start_and_size(local_vocab, logits.device, group, world_size)
        local_target = target.reshape(-1) - vocab_start
        local_target = local_target.masked_fill((local_target < 0) | (local_target >= local_vocab), -1)

        rows = max(1, _CHUNK_ELEMENTS // local_vocab)
        row_sums = label_smoothing > 0  # sum_j x_j enters the loss only with label smoothing
        chunks = [_chunk_statistics(logits[i : i + rows], local_target[i : i + rows], row_sums)
                  for i in range(0, len(logits), rows)]
        row_max, sum_exp, target_logit, sum_logits = (torch.cat(parts) for parts in zip(*chunks))
        if world_size > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            # e_r exp(m_r - M), x_t and sum_j x_j are sums over the ranks: one all-reduce for the three.
            summed = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit, sum_logits])
            dist.all_reduce(summed, group=group)
            sum_exp, target_logit, sum_logits = summed.unbind(0)
            row_max = global_max
        lse = row_max + torch.log(sum_exp)
        loss = lse - target_logit
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            loss = (1.0 - smoothing) * loss - smoothing * (sum_logits / vocab_size - lse)
        ctx.smoothing, ctx.vocab_size, ctx.rows, ctx.reuse_logits = smoothing, vocab_size, rows, reuse_logits
        ctx.save_for_backward(vocab_parallel_logits, lse, local_target)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        vocab_parallel_logits, lse, local_target = ctx.saved_tensors
        logits = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.size(-1))
        grad_output = grad_output.reshape(-1).float()
        grad = logits if ctx.reuse_logits else torch.empty_like(logits)
        for i in range(0, len(logits), ctx.rows):
            part = slice(i, i + ctx.rows)
            chunk = logits[part]
            # Reused, the chunk is passed as its own output: one tensor, which the compiled kernel updates in
            # place (two views of one memory would be aliased inputs to it).
            _chunk_gradient(chunk, lse[part], local_target[part], grad_output[part], ctx.smoothing, ctx.vocab_size,
                            chunk if ctx.reuse_logits else grad[part])
        return grad.view(vocab_parallel_logits.shape), None, None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0,
                                       reuse_logits: bool = False):
    """Per-token cross entropy [s, b] (fp32) of TP-split logits [s, b, V/p] (any float dtype) against ids
    [s, b]; equal to `vocab_parallel_cross_entropy` without its fp32 copies of the logits. `reuse_logits`: the
    backward overwrites the logits with their gradient (module docstring); only for logits nothing reads after
    the loss's backward."""
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, reuse_logits)
