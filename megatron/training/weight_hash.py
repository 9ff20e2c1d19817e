"""`--check-weight-hash-across-dp-replicas-interval N`: every N iterations, check that all data-parallel
replicas hold the same weights, as Megatron-LM does (a silent divergence, from a bad GPU or a missed
reduction, otherwise only shows as a slowly worse loss).

Each rank hashes every parameter of its model chunks (SHA-256 of the bytes); the hashes are gathered over
the data-parallel group (with context parallelism: its ranks hold the same weights too), or over the expert
data-parallel group for expert-parallel parameters, and compared. A mismatch stops the run naming the
parameters and the ranks that differ.
"""

import hashlib

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def _hashes(model, expert: bool) -> dict:
    """{parameter name: SHA-256 hex digest of its bytes} of the dense or the expert parameters."""
    hashes = {}
    for index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            if (not getattr(param, "allreduce", True)) == expert:
                data = param.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
                hashes[f"chunk {index} {name}"] = hashlib.sha256(data.tobytes()).hexdigest()
    return hashes


def _mismatches(group, expert: bool, model) -> list[str]:
    local = _hashes(model, expert)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    ranks = dist.get_process_group_ranks(group)
    problems = []
    for name in local:
        differing = [rank for rank, hashes in zip(ranks, gathered) if hashes.get(name) != gathered[0].get(name)]
        if differing:
            problems.append(f"{name}: global ranks {differing} differ from rank {ranks[0]}")
    return problems


def check_weight_hashes_across_dp_replicas(model, iteration: int) -> None:
    """Raises RuntimeError listing every parameter whose replicas differ (collective over all ranks)."""
    for chunk in model:
        if hasattr(chunk, "start_param_sync"):
            chunk.start_param_sync(force_sync=True)  # all-gathers of the distributed optimizer in flight
    problems = _mismatches(parallel_state.get_data_parallel_group(with_context_parallel=True), False, model)
    problems += _mismatches(parallel_state.get_expert_data_parallel_group(), True, model)
    if problems:
        raise RuntimeError(f"--check-weight-hash-across-dp-replicas-interval: at iteration {iteration} the "
                           f"data-parallel replicas hold different weights:\n  - " + "\n  - ".join(problems))
