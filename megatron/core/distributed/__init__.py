"""Data-parallel gradient handling: contiguous grad buffers, bucketed all-reduce, gradient finalisation, and
fully sharded data parallelism (FSDP2, Megatron-FSDP's sharding strategies)."""

from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .finalize_model_grads import finalize_model_grads
from .fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from .torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from ..lazy_names import lazy_names

# It loads torch.distributed.fsdp and DTensor (a second of start-up), which a run without --use-torch-fsdp2
# does not need.
__getattr__ = lazy_names(__name__, {"TorchFullyShardedDataParallel": ".torch_fully_sharded_data_parallel"})


__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
    "finalize_model_grads",
]
