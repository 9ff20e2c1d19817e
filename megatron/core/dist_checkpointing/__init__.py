"""Sharded checkpoints that load under another tensor/pipeline/data-parallel layout (`--ckpt-format
torch_dist`), built on `torch.distributed.checkpoint`, with Megatron-Core's names.

    mapping.py            ShardedTensor (a piece of a global tensor), ShardedObject (a per-rank object)
    model_sharding.py     a model's state dict as ShardedTensors under Megatron-Core's keys (layers stacked)
    optimizer_sharding.py optimizer state in model space (plain optimizer, fully_reshardable distributed one)
    optimizer_buckets.py  the distributed optimizer's state per DDP bucket (dp_reshardable)
    fully_parallel.py     spreading the writes of data-parallel replicas over the data-parallel ranks
    dcp_planners.py       the DCP planners that write and read boxes of global tensors
    serialization.py      save() / load() of a sharded state dict: metadata.json, DCP files, the common state
    unpickling.py         reading (and writing back) pickles with classes this installation lacks
    async_save.py         the background writer of --async-save
"""

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.lazy_names import lazy_names

# serialization.py's names on first use: it loads torch.distributed.checkpoint (over a second of start-up), which
# a run that writes and reads no torch_dist checkpoint does not need.
_SERIALIZATION = ("is_distributed_checkpoint", "load", "load_common_state_dict", "save", "saved_keys")
__getattr__ = lazy_names(__name__, dict.fromkeys(_SERIALIZATION, ".serialization"))


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
