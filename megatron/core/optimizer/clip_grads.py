"""Global gradient norm, clipping and zero counting over model-parallel ranks.

The model replica is spread over the ranks of a model-parallel group (TP x PP). Its global L2 norm is

    ||g|| = sqrt( sum over ranks r of sum over the params p counted on r of ||g_p||^2 )

where every gradient entry must be counted exactly once:
  * a tensor-parallel param (`tensor_model_parallel=True`) holds a different shard on each TP rank:
    every rank counts its shard;
  * any other param is a full copy on every TP rank: only TP rank 0 counts it;
  * a param marked `shared=True` is the second copy of a weight that lives on another pipeline stage
    (the tied output embedding on the last stage): that stage does not count it.

An FSDP-sharded gradient (a DTensor) counts with its local rows: the group then spans the data-parallel
ranks too (fully_sharded_optimizer.py).
"""

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from ..dtensor_shards import local_tensor
from ..tensor_parallel.layers import param_is_not_tensor_parallel_duplicate


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the second copy of a weight shared between pipeline stages (`shared=True`)."""
    return not getattr(param, "shared", False)


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    """Reduces over `group`; None means the statistic is local to this process."""
    if group is not None and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)


def get_grad_norm_fp32(
    grads_for_norm: Union[Iterable[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
) -> float:
    """The p-norm (2 or inf) of the gradients, reduced over `grad_stats_parallel_group`.

    `grads_for_norm` must already be filtered so that every entry is counted once over the group
    (see the module docstring). The sum of p-th powers is accumulated in fp32 and all-reduced, then the
    p-th root is taken, so the result equals the norm of the concatenation of all ranks' gradients.
    """
    return grad_norm_fp32_tensor(grads_for_norm, norm_type, grad_stats_parallel_group).item()


def grad_norm_fp32_tensor(
    grads_for_norm: Union[Iterable[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """`get_grad_norm_fp32` as a 1-element fp32 tensor on the gradients' device: no host sync."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = [local_tensor(grad).detach() for grad in grads_for_norm]
    norm_type = float(norm_type)
    device = grads[0].device if grads else _stats_device(grad_stats_parallel_group)

    if norm_type == float("inf"):
        total = torch.zeros(1, dtype=torch.float, device=device)
        if grads:
            total = torch.stack([grad.abs().max().float() for grad in grads]).max().reshape(1)
        _all_reduce(total, dist.ReduceOp.MAX, grad_stats_parallel_group)
        return total

    total = torch.zeros(1, dtype=torch.float, device=device)
    if grads:
        # ||g||_p^p = sum_p ||g_p||_p^p; the per-tensor norms come from one fused kernel.
        # In fp32 also for bf16/fp16 gradients (their norms would be rounded to their dtype); one call per
        # dtype, as torch's multi-tensor kernel takes one.
        by_dtype = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        per_tensor_norms = [norm for same in by_dtype.values()
                            for norm in torch._foreach_norm(same, norm_type, dtype=torch.float32)]
        total = torch.stack(per_tensor_norms).pow(norm_type).sum().reshape(1)
    _all_reduce(total, dist.ReduceOp.SUM, grad_stats_parallel_group)
    return total.pow(1.0 / norm_type)


def clip_grad_by_total_norm_fp32(
    parameters: Union[Iterable[torch.Tensor], torch.Tensor], max_norm: float, total_norm: float
) -> None:
    """Scales every `.grad` in place by `max_norm / (total_norm + 1e-6)` when that is below 1.

    Same coefficient as `torch.nn.utils.clip_grad_norm_`; `total_norm` is the global norm from
    `get_grad_norm_fp32`, so all ranks apply the same factor.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [local_tensor(param.grad).detach() for param in parameters if param.grad is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(
    parameters: Union[Iterable[torch.Tensor], torch.Tensor],
    grad_stats_parallel_group: Optional[dist.ProcessGroup] = None,
    tensor_parallel_rank: Optional[int] = None,
) -> int:
    """Number of zero gradient entries of the model replica, each entry counted once over the group."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    counted = [
        local_tensor(param.grad).detach()
        for param in parameters
        if param.grad is not None
        and param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param, tensor_parallel_rank)
    ]
    device = counted[0].device if counted else _stats_device(grad_stats_parallel_group)
    total = torch.zeros(1, dtype=torch.int64, device=device)
    for grad in counted:
        total += grad.numel() - torch.count_nonzero(grad)
    _all_reduce(total, dist.ReduceOp.SUM, grad_stats_parallel_group)
    return int(total.item())


def _stats_device(group) -> torch.device:
    """Device for a rank that holds no gradients but must still join the collective."""
    if group is not None and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
