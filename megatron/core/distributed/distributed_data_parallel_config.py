"""`DistributedDataParallelConfig`: how gradients are buffered and reduced over data-parallel ranks."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """Configuration of `DistributedDataParallel` (Megatron-Core's field names and defaults)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and all-reduce gradients in fp32 even for bf16/fp16 params (the training layer turns
    it on for bf16 unless `--grad-reduce-in-bf16`)."""

    overlap_grad_reduce: bool = False
    """Overlap the gradient all-reduce with the backward pass (`--overlap-grad-reduce`): not supported yet."""

    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with the forward pass (`--overlap-param-gather`): not supported yet."""

    align_param_gather: bool = False
    """Launch the parameter all-gathers of all pipeline stages together; only acts with
    `overlap_param_gather`, so on its own (the training layer sets it under virtual pipelining) it is a no-op."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter gradients for a sharded optimizer (`--use-distributed-optimizer`): not supported yet."""

    num_distributed_optimizer_instances: int = 1
    """Distributed-optimizer replicas within the data-parallel group: only 1 is supported."""

    check_for_nan_in_grad: bool = False
    """Raise (naming the rank and the bucket's params) when a local gradient is inf/nan before the all-reduce."""

    check_for_large_grads: bool = False
    """Flag unexpectedly large gradients before the all-reduce: not supported yet."""

    bucket_size: Optional[int] = None
    """Parameters per communication bucket; None puts each buffer in one bucket."""

    average_in_collective: bool = False
    """Average in the collective (ReduceOp.AVG) instead of pre-scaling gradients by 1/data-parallel size."""

    fp8_param_gather: bool = False
    """Keep params in fp8 and all-gather them in fp8 (`--fp8-param-gather`): not supported yet."""

    use_megatron_fsdp: bool = False
    """Megatron's FSDP code path (`--use-megatron-fsdp`): not supported yet."""

    def __post_init__(self):
        unsupported = [
            ("overlap_grad_reduce", "--overlap-grad-reduce"),
            ("overlap_param_gather", "--overlap-param-gather"),
            ("use_distributed_optimizer", "--use-distributed-optimizer"),
            ("check_for_large_grads", "--check-for-large-grads"),
            ("fp8_param_gather", "--fp8-param-gather"),
            ("use_megatron_fsdp", "--use-megatron-fsdp"),
        ]
        problems = [f"{name} ({flag}) is not supported yet" for name, flag in unsupported if getattr(self, name)]
        if self.num_distributed_optimizer_instances != 1:
            problems.append(
                f"num_distributed_optimizer_instances must be 1 (no distributed optimizer yet), "
                f"got {self.num_distributed_optimizer_instances}"
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            problems.append(f"bucket_size (--ddp-bucket-size) must be positive, got {self.bucket_size}")
        if problems:
            raise ValueError("invalid DistributedDataParallelConfig: " + "; ".join(problems))
