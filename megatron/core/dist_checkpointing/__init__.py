"""Sharded checkpoints that load under another tensor/pipeline/data-parallel layout (`--ckpt-format
torch_dist`), built on `torch.distributed.checkpoint`, with Megatron-Core's names.

    mapping.py            ShardedTensor (a piece of a global tensor), ShardedObject (a per-rank object)
    model_sharding.py     a model's state dict as ShardedTensors with global keys and layer numbers
    optimizer_sharding.py optimizer state (plain and distributed) as ShardedTensors on the params' keys
    fully_parallel.py     spreading the writes of data-parallel replicas over the data-parallel ranks
    dcp_planners.py       the DCP planners that write and read boxes of global tensors
    serialization.py      save() / load() of a sharded state dict: metadata.json, common.pt, DCP files
    async_save.py         the background writer of --async-save
"""

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.serialization import (
    is_distributed_checkpoint,
    load,
    load_common_state_dict,
    save,
    saved_keys,
)

__all__ = [
    "ShardedObject",
    "ShardedTensor",
    "is_distributed_checkpoint",
    "is_main_replica",
    "load",
    "load_common_state_dict",
    "save",
    "saved_keys",
]
