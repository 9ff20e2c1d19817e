"""Cross entropy over a vocabulary that is split across the tensor-parallel ranks.

For logits x (this rank holds the columns [start, start + V_local) of the V-wide row) and target t:

    loss = log(sum_j exp(x_j - m)) - (x_t - m),   m = max_j x_j
    d loss / d x_j = softmax(x)_j - [j == t]

computed in fp32 with three all-reduces of [s, b] tensors (max, target logit, sum of exps); the full
[s, b, V] logits are never gathered. With label smoothing a (Megatron's form, spreading a over the
V - 1 wrong classes): loss = (1 - a') * nll - a' * mean_j log softmax(x)_j with a' = a * V / (V - 1).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.host_group import all_gather_ints_on_host


def vocab_start_and_size(local_vocab: int, device, group, world_size: int) -> tuple[int, int]:
    """This rank's first vocabulary id and the full vocabulary size V, as Python ints.

    The shards may be uneven (partition.py), so the ranks tell each other their sizes; they do so over
    the group's gloo twin (host_group.py), host to host, so that no device value is read back on the
    host once per microbatch. `device` is not used (callers pass the logits' device).
    """
    if world_size == 1:
        return 0, local_vocab
    sizes = all_gather_ints_on_host(local_vocab, group)
    return sum(sizes[: dist.get_rank(group)]), sum(sizes)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing):
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None

        def all_reduce(tensor, op=dist.ReduceOp.SUM):
            if world_size > 1:
                dist.all_reduce(tensor, op=op, group=group)
            return tensor

        # logits: [s, b, V_local] fp32, shifted by the global row max for a stable exp.
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        logits = vocab_parallel_logits.float()
        logits_max = all_reduce(logits.amax(dim=-1), dist.ReduceOp.MAX).unsqueeze(-1)
        # bf16/fp16 logits were just copied to fp32, so that copy can be shifted in place (one [s, b, V/p]
        # fp32 buffer instead of two); fp32 logits belong to the caller and are left untouched.
        logits = logits - logits_max if logits is vocab_parallel_logits else logits.sub_(logits_max)
        local_vocab = logits.size(-1)
        vocab_start, vocab_size = vocab_start_and_size(local_vocab, logits.device, group, world_size)

        # Target logit: taken on the rank that owns the target id, zero elsewhere, then summed.
        target_outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(target_outside, 0)
        predicted_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted_logits = all_reduce(predicted_logits.masked_fill(target_outside, 0.0))

        if label_smoothing > 0:
            sum_logits = all_reduce(logits.sum(dim=-1))
        exp_logits = logits.exp_()
        sum_exp_logits = all_reduce(exp_logits.sum(dim=-1))
        loss = torch.log(sum_exp_logits) - predicted_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))

        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # mean_j log softmax_j = mean_j (x_j - m) - log(sum exp)
            mean_log_probs = sum_logits / vocab_size - torch.log(sum_exp_logits)
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        ctx.save_for_backward(softmax, target_outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_outside, local_target = ctx.saved_tensors
        grad_input = softmax  # reused in place: softmax is not needed afterwards
        on_this_rank = (~target_outside).to(grad_input.dtype).unsqueeze(-1)
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - ctx.smoothing) * on_this_rank)
        if ctx.smoothing > 0:
            grad_input.sub_(ctx.smoothing / ctx.vocab_size)
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0):
    """Per-token cross entropy [s, b] (fp32) of TP-split logits [s, b, V/p] against ids [s, b]."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
