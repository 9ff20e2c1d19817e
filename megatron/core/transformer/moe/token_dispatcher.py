"""Token dispatchers: bring each token to the ranks that hold its experts, and the outputs back.

Layout: E experts split over the EP ranks (rank j holds experts [j*E/ep, (j+1)*E/ep)); each expert's
MLP split over the expert-TP (ETP) ranks. Every rank routes its own T tokens (the MoE layer gives each
TP rank a different part of the sequence). Ranks of one ETP group hold shards of the same experts, so
they all need the same tokens and each returns a partial sum of the expert output.

allgather (`--moe-token-dispatcher-type allgather`), over the ETP x EP group of g ranks:
    all-gather tokens/probs/routing_map -> [g*T, h]; keep the slots of the local experts; permute;
    experts; unpermute to [g*T, h] (zeros where no local expert was chosen); reduce-scatter -> [T, h],
    which sums the ETP partial sums and the different experts' contributions in one collective.
alltoall (`alltoall`):
    all-gather over ETP (-> [t*T, h]); permute over all E experts; all-to-all over EP sending each
    rank the rows of its experts; reorder [source rank, expert] chunks to [expert, source rank];
    experts; the inverse reorder and all-to-all; unpermute; reduce-scatter over ETP -> [T, h].
Both give every expert its tokens in (source rank, token) order, the same rows as EP = 1 would see.
"""

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.token_permutation import all_to_all, permute, sort_chunks_by_idxs, unpermute


def _all_gather_map(routing_map: torch.Tensor, group) -> torch.Tensor:
    """All-gather of a bool [T, E] map along dim 0 (sent as uint8: not every backend gathers bools)."""
    return gather_from_sequence_parallel_region(routing_map.to(torch.uint8), group=group).bool()


class MoETokenDispatcher:
    """Base: the groups and this rank's experts. `dispatch` -> (rows grouped by local expert, tokens per
    local expert [E_local] on the CPU); `combine(rows)` -> [T, h] in the input dtype."""

    def __init__(self, num_local_experts: int, local_expert_indices: list, config):
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.etp_size = parallel_state.get_expert_tensor_parallel_world_size()

    def _local_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        start = self.local_expert_indices[0]
        return tensor[:, start : start + self.num_local_experts]


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather over ETP x EP, compute the local experts on every gathered token, reduce-scatter."""

    def __init__(self, num_local_experts: int, local_expert_indices: list, config):
        super().__init__(num_local_experts, local_expert_indices, config)
        self.group_size = self.etp_size * self.ep_size
        self.group = parallel_state.get_expert_tensor_and_model_parallel_group() if self.group_size > 1 else None

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.dtype = hidden_states.dtype
        if self.group_size > 1:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.group)  # [g*T, h]
            probs = gather_from_sequence_parallel_region(probs, group=self.group)
            routing_map = _all_gather_map(routing_map, self.group)
        self.num_tokens = hidden_states.size(0)
        rows, self.permuted_probs, self.sorted_indices, tokens_per_expert = permute(
            hidden_states, self._local_slice(routing_map), self._local_slice(probs)
        )
        return rows, tokens_per_expert.cpu()

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        output = unpermute(expert_output, self.permuted_probs, self.sorted_indices, self.num_tokens).to(self.dtype)
        if self.group_size > 1:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.group)  # [T, h]
        return output


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all over EP of only the routed rows (after an all-gather over ETP when ETP > 1)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list, config):
        super().__init__(num_local_experts, local_expert_indices, config)
        self.ep_group = parallel_state.get_expert_model_parallel_group() if self.ep_size > 1 else None
        self.etp_group = parallel_state.get_expert_tensor_parallel_group() if self.etp_size > 1 else None
        # Received chunk (source s, local expert e) sits at s * E_local + e; experts must come first.
        self.sort_input_by_local_experts = [
            source * num_local_experts + expert for expert in range(num_local_experts) for source in range(self.ep_size)
        ]
        self.restore_output_by_local_experts = [
            expert * self.ep_size + source for source in range(self.ep_size) for expert in range(num_local_experts)
        ]

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.dtype = hidden_states.dtype
        if self.etp_size > 1:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.etp_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.etp_group)
            routing_map = _all_gather_map(routing_map, self.etp_group)
        self.num_tokens = hidden_states.size(0)
        rows, self.permuted_probs, self.sorted_indices, tokens_per_expert = permute(hidden_states, routing_map, probs)
        if self.ep_size == 1:
            return rows, tokens_per_expert.cpu()
        # counts[s, e]: rows source rank s sends to expert e (global index), known to every EP rank.
        counts = gather_from_sequence_parallel_region(tokens_per_expert.unsqueeze(0), group=self.ep_group)
        counts = counts.cpu().view(self.ep_size, self.ep_size, self.num_local_experts)  # [source, dest, e]
        self.input_splits = counts[self.ep_rank].sum(dim=1).tolist()
        received = counts[:, self.ep_rank]  # [source, local expert]
        self.output_splits = received.sum(dim=1).tolist()
        self.received_chunk_sizes = received.reshape(-1).tolist()
        rows = all_to_all(self.ep_group, rows, self.output_splits, self.input_splits)
        rows = sort_chunks_by_idxs(rows, self.received_chunk_sizes, self.sort_input_by_local_experts)
        return rows, received.sum(dim=0)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:
            expert_major_sizes = [self.received_chunk_sizes[index] for index in self.sort_input_by_local_experts]
            expert_output = sort_chunks_by_idxs(
                expert_output, expert_major_sizes, self.restore_output_by_local_experts
            )
            expert_output = all_to_all(self.ep_group, expert_output, self.input_splits, self.output_splits)
        output = unpermute(expert_output, self.permuted_probs, self.sorted_indices, self.num_tokens).to(self.dtype)
        if self.etp_size > 1:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.etp_group)
        return output
