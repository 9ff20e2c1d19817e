"""Parallelism and distributed-runtime flags.

The dense ranks factor as world = TP x CP x DP x PP (rank order `tp-cp-ep-dp-pp`, TP fastest). DP is never
given: validation derives it as world / (TP x PP x CP).
"""

import os
from dataclasses import dataclass

from megatron.training.config.fields import Section, flag


def _launcher_local_rank() -> int:
    """LOCAL_RANK as torchrun sets it, read when the parser is built (0 without a launcher)."""
    return int(os.getenv("LOCAL_RANK", "0"))


@dataclass(kw_only=True)
class DistributedConfig(Section):
    """The parallel layout, data-parallel communication and the torch.distributed runtime."""

    TITLE = "distributed"

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (TP)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (PP)."""

    context_parallel_size: int = 1
    """Context-parallel size (CP); the sequence length must be divisible by 2 x CP."""

    cp_comm_type: list[str] = flag(default_factory=lambda: ["p2p"], nargs="+")
    """Context-parallel communication: p2p, a2a, allgather or a2a+p2p (one per layer or one for all)."""

    hierarchical_context_parallel_sizes: list[int] | None = flag(None, nargs="+")
    """Context-parallel sizes per level for a2a+p2p."""

    expert_model_parallel_size: int = 1
    """Expert-parallel size (EP)."""

    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size inside experts (default: TP)."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (interleaved schedule)."""

    num_virtual_stages_per_pipeline_rank: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule)."""

    pipeline_model_parallel_layout: str | None = None
    """Explicit layer layout of the pipeline stages, e.g. "E|(t|)*3,m|m||L"."""

    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (uneven split)."""

    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (uneven split)."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as one layer when splitting layers over stages."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as one layer when splitting layers over stages."""

    microbatch_group_size_per_vp_stage: int | None = flag(
        None, names=("--microbatch-group-size-per-virtual-pipeline-stage",))
    """Contiguous microbatches per virtual stage (default: PP)."""

    overlap_p2p_comm: bool = flag(True, names=("--no-overlap-p2p-communication",))
    """Do not overlap pipeline send/receive with compute (off without virtual stages)."""

    scatter_gather_tensors_in_pipeline: bool = flag(True, names=("--no-scatter-gather-tensors-in-pipeline",))
    """Send whole activations between stages instead of TP-scattered chunks."""

    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence within the TP group (off when TP = 1)."""

    tp_comm_overlap: bool = False
    """Overlap tensor-parallel communication with GEMMs (needs --sequence-parallel)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with the forward pass (distributed optimizer)."""

    align_grad_reduce: bool = flag(True, names=("--no-align-grad-reduce",))
    """Let each pipeline stage launch its gradient reduction independently."""

    align_param_gather: bool = flag(True, names=("--no-align-param-gather",))
    """Let each pipeline stage launch its parameter all-gather independently."""

    ddp_bucket_size: int | None = None
    """Parameters per gradient bucket (default max(4e7, 1e6 x DP) when overlapping)."""

    ddp_average_in_collective: bool = False
    """Average gradients inside the collective instead of pre-scaling them."""

    use_torch_fsdp2: bool = False
    """Shard parameters with PyTorch FSDP2."""

    use_megatron_fsdp: bool = False
    """Shard parameters with Megatron FSDP."""

    gradient_accumulation_fusion: bool = flag(True, names=("--no-gradient-accumulation-fusion",))
    """Do not fuse weight-gradient accumulation into the fp32 main_grad buffer."""

    use_tp_pp_dp_mapping: bool = False
    """Order ranks tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp."""

    distributed_backend: str = flag("nccl", choices=("nccl", "gloo"))
    """torch.distributed backend."""

    distributed_timeout_minutes: int = 10
    """Timeout of torch.distributed collectives."""

    # torch.distributed.launch passes --local_rank; torchrun sets LOCAL_RANK.
    local_rank: int = flag(default_factory=_launcher_local_rank, names=("--local-rank", "--local_rank"))
    """Local rank from the launcher (default: LOCAL_RANK)."""
