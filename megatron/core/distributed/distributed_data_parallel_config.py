"""`DistributedDataParallelConfig`: how gradients are buffered and reduced over data-parallel ranks."""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DistributedDataParallelConfig:
    """Configuration of `DistributedDataParallel` (Megatron-Core's field names and defaults)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and all-reduce gradients in fp32 even for bf16/fp16 params (the training layer turns
    it on for bf16 unless `--grad-reduce-in-bf16`)."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction during the last microbatch's backward, as soon as its gradients are
    complete (`--overlap-grad-reduce`)."""

    overlap_param_gather: bool = False
    """Gather the distributed optimizer's updated params bucket by bucket during the next forward
    (`--overlap-param-gather`); needs `use_distributed_optimizer`."""

    align_param_gather: bool = False
    """Launch the parameter all-gathers of all pipeline stages together (the training layer sets it under
    virtual pipelining); it would act only with `overlap_param_gather` under pipeline parallelism, which is
    not supported yet, so it is a no-op."""

    use_distributed_optimizer: bool = False
    """Pad the buffers for sharding, keep the params in a buffer too, and reduce-scatter the gradients for
    the distributed optimizer (`--use-distributed-optimizer`)."""

    num_distributed_optimizer_instances: int = 1
    """Distributed-optimizer replicas within the data-parallel group: only 1 is supported."""

    check_for_nan_in_grad: bool = False
    """Raise (naming the rank and the bucket's params) when a local gradient is inf/nan before the all-reduce."""

    check_for_large_grads: bool = False
    """Flag unexpectedly large gradients before the all-reduce: not supported yet."""

    bucket_size: Optional[int] = None
    """Elements per communication bucket with `overlap_grad_reduce` (None: max(4e7, 1e6 x dp)); without
    overlap every buffer is one bucket."""

    average_in_collective: bool = False
    """Average in the collective (ReduceOp.AVG) instead of pre-scaling gradients by 1/data-parallel size."""

    fp8_param_gather: bool = False
    """The model stores the weights of its FP8 GEMMs in FP8 (`TransformerConfig.fp8_param`): they get uint8 param
    buffers, so the distributed optimizer casts its main params into them and all-gathers FP8 bytes
    (`--fp8-param-gather`)."""

    use_megatron_fsdp: bool = False
    """Megatron-FSDP (`--use-megatron-fsdp`): wrap with `FullyShardedDataParallel`, which shards as
    `data_parallel_sharding_strategy` says (distributed/fsdp/mcore_fsdp_adapter.py)."""

    data_parallel_sharding_strategy: str = "no_shard"
    """With `use_megatron_fsdp`: no_shard, optim, optim_grads or optim_grads_params
    (`--data-parallel-sharding-strategy`)."""

    megatron_fsdp_main_params_dtype: Optional[torch.dtype] = torch.float32
    """With `use_megatron_fsdp`: the dtype of the main params the optimizer updates (None: the model's
    dtype). Only float32 is built (`--megatron-fsdp-main-params-dtype`)."""

    megatron_fsdp_main_grads_dtype: Optional[torch.dtype] = None
    """With `use_megatron_fsdp`: the dtype gradients are accumulated in (None: as built, see
    `built_megatron_fsdp_dtypes`; `--megatron-fsdp-main-grads-dtype`)."""

    megatron_fsdp_grad_comm_dtype: Optional[torch.dtype] = None
    """With `use_megatron_fsdp`: the dtype gradients are reduced in (None: the main grads' dtype;
    `--megatron-fsdp-grad-comm-dtype`)."""

    def __post_init__(self):
        unsupported = [("check_for_large_grads", "--check-for-large-grads")]
        problems = [f"{name} ({flag}) is not supported yet" for name, flag in unsupported if getattr(self, name)]
        if self.num_distributed_optimizer_instances != 1:
            problems.append(
                f"num_distributed_optimizer_instances must be 1 (partial distributed optimizers "
                f"(--num-distributed-optimizer-instances) are not supported yet), got "
                f"{self.num_distributed_optimizer_instances}"
            )
        if self.overlap_param_gather and not (self.use_distributed_optimizer or self.use_megatron_fsdp):
            problems.append("overlap_param_gather (--overlap-param-gather) needs use_distributed_optimizer "
                            "(--use-distributed-optimizer) or use_megatron_fsdp: only their params are gathered")
        if self.bucket_size is not None and self.bucket_size <= 0:
            problems.append(f"bucket_size (--ddp-bucket-size) must be positive, got {self.bucket_size}")
        if problems:
            raise ValueError("invalid DistributedDataParallelConfig: " + "; ".join(problems))
