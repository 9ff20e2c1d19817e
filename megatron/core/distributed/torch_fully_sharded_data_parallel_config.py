"""`TorchFullyShardedDataParallelConfig`: the DDP config of a model sharded with PyTorch FSDP2."""

from dataclasses import dataclass

from .distributed_data_parallel_config import DistributedDataParallelConfig


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """Configuration of `TorchFullyShardedDataParallel` (Megatron-Core's name and field)."""

    reshard_after_forward: bool = True
    """Free each unit's gathered params after its forward and gather them again for its backward (ZeRO-3).
    False keeps them from the forward to the backward (one all-gather per microbatch instead of two: the
    `optim_grads` strategy, ZeRO-2 memory during the step); `--torch-fsdp2-no-reshard-after-forward`."""
