"""Core attention of a layer whose sequence is split over the context-parallel (CP) ranks.

Each rank holds two chunks of the sequence (batch_split.py); its queries must still attend to the keys
and values of every rank. `cp_comm_type` picks how those reach it (Megatron's names):

    "p2p"         ring exchange of key/value blocks, one neighbour at a time (ring_attention.py):
                  memory for two blocks, communication overlapped with computation
    "all_gather"  gather every rank's keys/values at once (all_gather_attention.py): simpler, memory for
                  the whole sequence's keys/values ("allgather", as Megatron's --help spells it, is accepted)
    "a2a", "a2a+p2p"  (Ulysses head/sequence all-to-all) are not supported yet
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel.all_gather_attention import all_gather_attention
from megatron.core.transformer.context_parallel.block_attention import grouped_keys, grouped_queries, ungrouped_output
from megatron.core.transformer.context_parallel.ring_attention import RingAttention

CP_COMM_TYPES = ("p2p", "all_gather")
CP_COMM_TYPES_NOT_YET = ("a2a", "a2a+p2p")
_ALIASES = {"allgather": "all_gather"}
_RANK_SEED_STRIDE = 7919  # CP ranks' dropout seeds differ by this (all-gather uses seed and seed + 1)


def canonical_cp_comm_type(comm_type: str) -> str:
    """Megatron's spelling of a CP communication type ("allgather" -> "all_gather")."""
    return _ALIASES.get(comm_type, comm_type)


def cp_comm_type_problems(cp_comm_type, num_layers: int) -> list[str]:
    """What is wrong with a `cp_comm_type` setting: one name for all layers or a list of one per layer."""
    names = [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)
    problems = []
    if not isinstance(cp_comm_type, str) and len(names) != num_layers:
        problems.append(f"cp_comm_type lists {len(names)} types; give one for all layers or one per layer "
                        f"({num_layers})")
    for name in dict.fromkeys(canonical_cp_comm_type(name) for name in names):
        if name in CP_COMM_TYPES_NOT_YET:
            problems.append(f"cp_comm_type {name!r} is not supported yet; use p2p or all_gather")
        elif name not in CP_COMM_TYPES:
            problems.append(f"unknown cp_comm_type {name!r}; valid: {', '.join(CP_COMM_TYPES + CP_COMM_TYPES_NOT_YET)}")
    return problems


def cp_comm_type_of_layer(cp_comm_type, layer_number: int) -> str:
    """The communication type of layer `layer_number` (1-based, global) from the config's setting."""
    if cp_comm_type is None:
        return "p2p"
    name = cp_comm_type if isinstance(cp_comm_type, str) else cp_comm_type[layer_number - 1]
    return canonical_cp_comm_type(name)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    comm_type: str = "p2p",
    group=None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    use_cudnn: bool = True,
) -> torch.Tensor:
    """softmax(Q K^T * scale [+ causal mask]) V over the whole sequence, for this rank's queries.

    query [2n, b, np, d], key/value [2n, b, ng, d]: this CP rank's chunks r and 2c-1-r, n tokens each.
    Returns the context [2n, b, np * d]. `group` defaults to the CP group of parallel_state. Attention
    dropout with probability `dropout_p` needs `dropout_seed`; each CP rank derives its own masks from it.
    `use_cudnn=False` (--attention-backend flash) keeps the blocks in the flash kernel (block_attention.py).
    """
    group = parallel_state.get_context_parallel_group() if group is None else group
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("context-parallel attention with dropout_p > 0 needs a dropout_seed")
    seed = None if dropout_p == 0 else dropout_seed + _RANK_SEED_STRIDE * dist.get_rank(group)
    if query.size(0) % 2:
        raise ValueError(f"context-parallel attention needs this rank's two equal chunks; got {query.size(0)} rows")
    comm_type = canonical_cp_comm_type(comm_type)
    if comm_type == "p2p":
        groups = key.size(2)
        out = RingAttention.apply(
            grouped_queries(query, groups), grouped_keys(key), grouped_keys(value), softmax_scale, causal, group,
            dropout_p, seed, use_cudnn,
        )
    elif comm_type == "all_gather":
        out = all_gather_attention(
            query, key, value, softmax_scale, causal, group, dist.get_rank(group), dist.get_world_size(group),
            dropout_p, seed, use_cudnn,
        )
    else:
        raise ValueError(f"cp_comm_type {comm_type!r} is not supported yet; use p2p or all_gather")
    return ungrouped_output(out)
