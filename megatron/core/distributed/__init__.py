"""Data-parallel gradient handling: contiguous grad buffers, bucketed all-reduce, gradient finalisation, and
fully sharded data parallelism (FSDP2, Megatron-FSDP's sharding strategies)."""

from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .finalize_model_grads import finalize_model_grads
from .fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from .torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig


def __getattr__(name):
    """`TorchFullyShardedDataParallel` on first use: it loads torch.distributed.fsdp and DTensor (a second of
    start-up), which a run without --use-torch-fsdp2 does not need."""
    if name == "TorchFullyShardedDataParallel":
        from .torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel
    raise AttributeError(f"module 'megatron.core.distributed' has no attribute {name!r}")


__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
    "finalize_model_grads",
]
