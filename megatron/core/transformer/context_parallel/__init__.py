"""Context parallelism: the sequence split over CP ranks (batch_split.py) and attention across them
(context_parallel_attention.py: ring or all-gather, built on block_attention.py)."""

from megatron.core.transformer.context_parallel.batch_split import (
    get_batch_on_this_cp_rank,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.transformer.context_parallel.context_parallel_attention import (
    CP_COMM_TYPES,
    context_parallel_attention,
    cp_comm_type_of_layer,
    cp_comm_type_problems,
)

__all__ = [
    "CP_COMM_TYPES",
    "context_parallel_attention",
    "cp_comm_type_of_layer",
    "cp_comm_type_problems",
    "get_batch_on_this_cp_rank",
    "get_pos_emb_on_this_cp_rank",
]
