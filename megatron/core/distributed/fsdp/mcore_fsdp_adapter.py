"""Megatron-FSDP's sharding strategies (`--use-megatron-fsdp --data-parallel-sharding-strategy S`), and the one
place that wraps a model chunk for data parallelism.

What each of the n data-parallel ranks keeps 1/n of, and what builds it here:

    strategy              sharded (ZeRO stage)                  built from
    no_shard              nothing                               DistributedDataParallel: all-reduced grads
    optim                 optimizer state (1)                   DistributedDataParallel + DistributedOptimizer:
                                                                grads reduce-scattered, params all-gathered
    optim_grads           + gradients (2)                       ShardedGradDataParallel + DistributedOptimizer:
                                                                each backward reduce-scatters into fp32 grad
                                                                shards, no whole grad buffer (sharded_grads.py)
    optim_grads_params    + params (3)                          ShardedParamDataParallel + DistributedOptimizer:
                                                                each rank keeps its shard of the param buffer,
                                                                buckets gathered around their layers' forward and
                                                                backward (sharded_params.py)

`optim`, `optim_grads` and `optim_grads_params` need OptimizerConfig.use_distributed_optimizer (the training
arguments turn it on). PyTorch FSDP2 (TorchFullyShardedDataParallel, fp32 params as its main params, no
Float16Module, the FullyShardedOptimizer) is --use-torch-fsdp2's.
"""

import dataclasses

import torch

from ..distributed_data_parallel import DistributedDataParallel
from ..distributed_data_parallel_config import DistributedDataParallelConfig
from ..torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from .sharded_grads import ShardedGradDataParallel
from .sharded_params import ShardedParamDataParallel

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_DISTRIBUTED_OPTIMIZER = ("optim", "optim_grads", "optim_grads_params")
_SHARDED_GRADS = {"optim_grads": ShardedGradDataParallel, "optim_grads_params": ShardedParamDataParallel}


def _strategy(ddp_config: DistributedDataParallelConfig) -> str:
    strategy = ddp_config.data_parallel_sharding_strategy
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"data_parallel_sharding_strategy (--data-parallel-sharding-strategy) {strategy!r} is not one "
                         f"of {', '.join(SHARDING_STRATEGIES)}")
    return strategy


def uses_distributed_optimizer(ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether the strategy's optimizer is the DistributedOptimizer (`optim`, `optim_grads`, `optim_grads_params`)."""
    return ddp_config.use_megatron_fsdp and _strategy(ddp_config) in _DISTRIBUTED_OPTIMIZER


def shards_params(ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether the chunk is wrapped by TorchFullyShardedDataParallel (--use-torch-fsdp2): it then stays in fp32
    (its params are the main params; the compute dtype is applied as they are gathered). Megatron-FSDP's
    optim_grads_params shards bf16 params under a Float16Module instead (`shards_params_on_buffers`)."""
    return isinstance(ddp_config, TorchFullyShardedDataParallelConfig)


def shards_params_on_buffers(ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether the chunk is a ShardedParamDataParallel (--use-megatron-fsdp optim_grads_params: ZeRO-3 on DDP's
    buffers)."""
    return (not shards_params(ddp_config) and ddp_config.use_megatron_fsdp
            and _strategy(ddp_config) == "optim_grads_params")


_DTYPE_FLAGS = {"megatron_fsdp_main_params_dtype": "--megatron-fsdp-main-params-dtype",
                "megatron_fsdp_main_grads_dtype": "--megatron-fsdp-main-grads-dtype",
                "megatron_fsdp_grad_comm_dtype": "--megatron-fsdp-grad-comm-dtype"}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def built_megatron_fsdp_dtypes(strategy: str, grad_reduce_in_fp32: bool, params_dtype: torch.dtype) -> dict:
    """{dtype field: what the strategy's wrapper here uses}. Main params: fp32 (the sharded strategies' params
    are fp32 shards, the others keep the optimizer's fp32 main copies). Gradients are reduced in fp32 with
    `grad_reduce_in_fp32`, else in the params' dtype, and accumulated in the fp32 shards (sharded strategies) or
    in DDP's buffer of the reduction dtype."""
    reduced = torch.float32 if grad_reduce_in_fp32 else params_dtype
    return {"megatron_fsdp_main_params_dtype": torch.float32,
            "megatron_fsdp_main_grads_dtype": torch.float32 if strategy.startswith("optim_grads") else reduced,
            "megatron_fsdp_grad_comm_dtype": reduced}


def megatron_fsdp_dtype_mismatches(settings, grad_reduce_in_fp32: bool, params_dtype: torch.dtype) -> list:
    """One message per dtype field of `settings` (a DistributedDataParallelConfig, or the validated arguments: the
    same names) that asks for another dtype than `built_megatron_fsdp_dtypes`. Unset (None) means: main params in
    the model's dtype, main grads as built, communication in the main grads' dtype."""
    asked = {"megatron_fsdp_main_params_dtype": settings.megatron_fsdp_main_params_dtype or params_dtype,
             "megatron_fsdp_main_grads_dtype": settings.megatron_fsdp_main_grads_dtype,
             "megatron_fsdp_grad_comm_dtype": (settings.megatron_fsdp_grad_comm_dtype
                                               or settings.megatron_fsdp_main_grads_dtype)}
    strategy = settings.data_parallel_sharding_strategy
    built = built_megatron_fsdp_dtypes(strategy, grad_reduce_in_fp32, params_dtype)
    return [f"{field} ({_DTYPE_FLAGS[field]}) {_DTYPE_NAMES[dtype]} is not supported yet: Megatron-FSDP's "
            f"{strategy} strategy here uses {_DTYPE_NAMES[built[field]]}"
            for field, dtype in asked.items() if dtype is not None and dtype != built[field]]


def FullyShardedDataParallel(config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                             disable_bucketing: bool = False, **unused):
    """Megatron-Core's Megatron-FSDP wrapper, by `ddp_config.data_parallel_sharding_strategy` (module docstring):
    a DistributedDataParallel (no_shard, optim), a ShardedGradDataParallel (optim_grads) or a
    ShardedParamDataParallel (optim_grads_params). Keyword arguments of Megatron's (process-group collections,
    FSDP unit classes) are accepted and not used: the groups come from parallel_state, the units are fixed."""
    strategy = _strategy(ddp_config)
    mismatches = megatron_fsdp_dtype_mismatches(ddp_config, ddp_config.grad_reduce_in_fp32, config.params_dtype)
    if mismatches:
        raise ValueError("; ".join(mismatches))
    fields = {field.name: getattr(ddp_config, field.name) for field in dataclasses.fields(DistributedDataParallelConfig)}
    fields["use_megatron_fsdp"] = False
    fields["use_distributed_optimizer"] = strategy in _DISTRIBUTED_OPTIMIZER
    if strategy in _SHARDED_GRADS:
        # Each backward reduce-scatters bucket by bucket, and ZeRO-3 prefetches the next unit's params (as
        # Megatron-FSDP, whatever the overlap flags say).
        fields.update(overlap_grad_reduce=True, overlap_param_gather=strategy == "optim_grads_params")
        wrapped = _SHARDED_GRADS[strategy](config, DistributedDataParallelConfig(**fields), module, disable_bucketing)
        wrapped.broadcast_params()
        return wrapped
    if strategy == "no_shard":
        fields["overlap_param_gather"] = False  # nothing is gathered: the all-reduce overlaps, as in Megatron-FSDP
    return wrap_data_parallel(config, DistributedDataParallelConfig(**fields), module, disable_bucketing)


def wrap_data_parallel(config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                       disable_bucketing: bool = False) -> torch.nn.Module:
    """`module` wrapped as `ddp_config` asks: TorchFullyShardedDataParallel for a
    TorchFullyShardedDataParallelConfig (--use-torch-fsdp2), the strategy's wrapper with `use_megatron_fsdp`,
    else DistributedDataParallel; the params are the same on every data-parallel rank afterwards."""
    if isinstance(ddp_config, TorchFullyShardedDataParallelConfig):
        from ..torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel  # loads FSDP2: only here

        return TorchFullyShardedDataParallel(config, ddp_config, module)
    if ddp_config.use_megatron_fsdp:
        return FullyShardedDataParallel(config, ddp_config, module, disable_bucketing=disable_bucketing)
    ddp = DistributedDataParallel(config, ddp_config, module, disable_bucketing=disable_bucketing)
    ddp.broadcast_params()
    return ddp
