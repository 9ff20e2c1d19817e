"""`FullyShardedOptimizer`: Adam (or SGD) on the params of a model sharded by `TorchFullyShardedDataParallel`.

Those params are fp32 DTensors, each rank holding its rows of every param (dtensor_shards.py); they
are the main params, so there is no copy to keep: the inner torch optimizer updates the shards in place and
its moments are DTensors of the same layout. The gradients arrive reduce-scattered (the mean over the
data-parallel ranks) in the shards' `.grad`.

The gradient norm and zero count must see every element once. Rank (dp, tp, pp) holds rows of dp's share of
the TP-local params of stage pp, so the sums of squares are reduced over all ranks, with the usual filters:
TP-replicated params counted on TP rank 0 only, a pipeline stage's second copy of a tied weight not at all
(clip_grads.py):

    ||g||^2 = sum over every rank of  sum over its counted shards s of ||g_s||^2

Checkpoints use the layout of the optimizer a DDP run of the same precision has (optimizer_sharding.py): that
of `FP32Optimizer` for fp32, that of `Float16OptimizerWithFloat16Params` for bf16 (`saves_main_params`: the
shards are also written as the fp32 main params, the model entry holds their bf16 rounding), so either run
resumes from the other.
"""

from typing import Optional

import torch
import torch.distributed as dist

from .optimizer import FP32Optimizer
from .optimizer_config import OptimizerConfig


class FullyShardedOptimizer(FP32Optimizer):
    """The Megatron optimizer over FSDP-sharded fp32 params computed in `compute_dtype` (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, compute_dtype: torch.dtype):
        problems = []
        if config.fp16 or config.loss_scale is not None:
            problems.append("loss scaling (--fp16, --loss-scale) over sharded gradients is not supported yet")
        if config.use_precision_aware_optimizer:
            problems.append("--use-precision-aware-optimizer is not supported yet (the Adam moments stay fp32)")
        if problems:
            raise ValueError("FSDP (--use-torch-fsdp2, --use-megatron-fsdp): " + "; ".join(problems))
        super().__init__(optimizer, config)
        self.compute_dtype = compute_dtype
        # Every rank holds other elements (module docstring).
        self.grad_stats_parallel_group = dist.group.WORLD

    def saves_main_params(self) -> bool:
        """Whether a checkpoint lists the shards as fp32 main params of a model saved in `compute_dtype`."""
        return self.compute_dtype != torch.float32

    @torch.no_grad()
    def step_with_ready_grads(self, skip: Optional[torch.Tensor] = None) -> bool:
        grad_scale = getattr(self.optimizer, "grad_scale", None)
        if grad_scale is not None:
            # A 0-dim scale is what DTensor's dispatch replicates over the mesh without a warning.
            self.optimizer.grad_scale = grad_scale.reshape(())
        return super().step_with_ready_grads(skip)

    def state_dict(self) -> dict:
        raise ValueError("the state of an FSDP optimizer is sharded over the data-parallel ranks: save it with "
                         "--ckpt-format torch_dist (--ckpt-format torch keeps one data-parallel rank's file)")

    def load_state_dict(self, state_dict: dict) -> None:
        raise ValueError("the state of an FSDP optimizer loads from a --ckpt-format torch_dist checkpoint only")
