"""This rank's place in the run's parallel layout, read once: the sizes, ranks and process groups the training
loop needs, instead of asking `parallel_state` for each of them where it is used.

    world size = tensor (TP) x pipeline (PP) x context (CP) x data (DP)
    experts:     expert-tensor (ETP) x expert (EP) x expert-data (EDP), over the same ranks

The data-parallel group below is DP without CP; gradients and loss sums are reduced over DP x CP (context
parallel ranks hold different tokens of the same sequences), which `data_context_parallel_group` spans.
`parallel_state` stays the owner of the groups (megatron.core reads it); this object is built from it after
`initialize_model_parallel` and handed to the training code that needs it.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.datasets.rank_logging import global_rank


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, this rank's coordinates and the groups of the layout (module docstring)."""

    world_size: int
    rank: int
    tensor_parallel_size: int
    tensor_parallel_rank: int
    pipeline_parallel_size: int
    pipeline_parallel_rank: int
    virtual_pipeline_parallel_size: int | None
    context_parallel_size: int
    context_parallel_rank: int
    data_parallel_size: int
    data_parallel_rank: int
    data_context_parallel_rank: int  # within DP x CP
    expert_parallel_size: int
    expert_parallel_rank: int
    expert_tensor_parallel_rank: int
    expert_data_parallel_rank: int
    tensor_parallel_group: object
    data_parallel_group: object
    data_context_parallel_group: object
    # Where small tensors for collectives live: the current GPU under NCCL, else the CPU.
    device: torch.device

    @classmethod
    def from_parallel_state(cls) -> "ParallelLayout":
        """The layout `initialize_model_parallel` set up (collective-free: reads the groups' sizes and ranks)."""
        return cls(
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            rank=global_rank(),
            tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
            pipeline_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            pipeline_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
            virtual_pipeline_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
            context_parallel_rank=parallel_state.get_context_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_context_parallel_rank=parallel_state.get_data_parallel_rank(with_context_parallel=True),
            expert_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_parallel_rank=parallel_state.get_expert_model_parallel_rank(),
            expert_tensor_parallel_rank=parallel_state.get_expert_tensor_parallel_rank(),
            expert_data_parallel_rank=parallel_state.get_expert_data_parallel_rank(),
            tensor_parallel_group=parallel_state.get_tensor_model_parallel_group(),
            data_parallel_group=parallel_state.get_data_parallel_group(),
            data_context_parallel_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            device=parallel_state.collective_device(),
        )

    @property
    def data_context_parallel_size(self) -> int:
        """DP x CP: the ranks over which gradients and loss sums are reduced."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def is_first_stage(self) -> bool:
        """The pipeline rank that embeds (whatever its virtual stages)."""
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The pipeline rank that computes the loss (whatever its virtual stages)."""
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    @property
    def num_model_chunks(self) -> int:
        """Model chunks on this rank: one per virtual pipeline stage, one without virtual stages."""
        return self.virtual_pipeline_parallel_size or 1
