"""Fully parallel saving: the data-parallel ranks share the writing of what they all hold.

Every DP rank holds the same model pieces (and plain-optimizer state); by default DP rank 0 alone would
write them. Instead each piece is given to one DP rank, largest first to the least loaded rank, so
the bytes spread evenly. All DP ranks compute the same assignment from the same list of pieces, with
no communication.
"""

from typing import List

from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica


def distribute_replica_writes(tensors: List[ShardedTensor], data_parallel_rank: int, data_parallel_size: int) -> None:
    """Rewrites the DP part (last entry) of the replica ids of `tensors` - pieces replicated over the
    data-parallel ranks, the same list on each of them - so that exactly one DP rank writes each."""
    candidates = [tensor for tensor in tensors if isinstance(tensor.replica_id, tuple)
                  and is_main_replica(tensor.replica_id[:-1])]
    candidates.sort(key=lambda tensor: (-tensor.data.numel() * tensor.data.element_size(), tensor.key,
                                        tensor.global_offset))
    load = [0] * data_parallel_size
    for tensor in candidates:
        owner = min(range(data_parallel_size), key=lambda rank: (load[rank], rank))
        load[owner] += tensor.data.numel() * tensor.data.element_size()
        tensor.replica_id = (*tensor.replica_id[:-1], 0 if owner == data_parallel_rank else 1)
