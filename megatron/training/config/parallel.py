"""Parallelism and distributed-runtime flags.

The dense ranks factor as world = TP x CP x DP x PP (rank order `tp-cp-ep-dp-pp`, TP fastest). DP is never
given: validation derives it as world / (TP x PP x CP).
"""

import math
import os
from dataclasses import dataclass

import torch

from megatron.core.nccl_settings import load_communicator_settings
from megatron.training.config.fields import Section, flag


# Megatron-FSDP's dtype flags as Megatron-LM's validation turns them into torch dtypes (auto: None); a validated
# namespace holds the dtypes already.
_MEGATRON_FSDP_DTYPE_FIELDS = ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype",
                               "megatron_fsdp_grad_comm_dtype")
_MEGATRON_FSDP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}


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
    """Explicit layer placement: stages separated by "|", E embedding, t transformer layer, m MTP layer, L loss,
    "(...)*n" / "x*n" repeats, e.g. "Et*3|(tt|)*6tmL"; PP ranks x virtual stages = the number of stages."""

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

    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence within the TP group (off when TP = 1)."""

    tp_comm_overlap: bool = False
    """Overlap tensor-parallel communication with GEMMs (needs --sequence-parallel)."""

    tp_comm_overlap_cfg: str | None = None
    """Megatron-LM: the YAML file configuring Transformer Engine's userbuffers for --tp-comm-overlap. The
    overlap here is this framework's own and takes no configuration."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    use_layer_wise_param_layout: bool = flag(True, names=("--no-use-layer-wise-param-layout",))
    """Megatron-LM: with --optimizer muon --use-distributed-optimizer, fall back from its precomputed
    layer-wise buffer layout to the older one (the same updates, another reduction order)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with the forward pass (distributed optimizer)."""

    align_grad_reduce: bool = flag(True, names=("--no-align-grad-reduce", "--disable-align-grad-reduce"))
    """Let each pipeline stage launch its gradient reduction independently."""

    align_param_gather: bool = flag(True, names=("--no-align-param-gather",))
    """Let each pipeline stage launch its parameter all-gather independently."""

    num_distributed_optimizer_instances: int = 1
    """Megatron-LM: copies of the distributed optimizer over the data-parallel group (each shards over DP /
    instances ranks; fewer, faster collectives). Here the state is sharded over the whole data-parallel
    group: the same results, less memory per rank."""

    overlap_param_gather_with_optimizer_step: bool = False
    """Megatron-LM: start the first bucket's parameter all-gather during the optimizer step (interleaved
    pipelines). Here the all-gathers overlap the next forward pass only."""

    defer_embedding_wgrad_compute: bool = False
    """Megatron-LM: compute the output layer's weight gradients during the pipeline flush. Here they are
    computed in each microbatch's backward pass (the same gradients)."""

    wgrad_deferral_limit: int = 0
    """Microbatches whose output-layer weight gradients --defer-embedding-wgrad-compute defers (0: all)."""

    overlap_p2p_comm_warmup_flush: bool = flag(False, names=("--overlap-p2p-communication-warmup-flush",))
    """Megatron-LM: also overlap pipeline send/receive in the warm-up and flush of the interleaved
    schedule. Here pipeline transfers are not overlapped with compute."""

    use_gloo_process_groups: bool = flag(True, names=("--disable-gloo-process-groups",))
    """Megatron-LM: make no gloo process groups (they cost host memory and file descriptors). Here the
    distributed optimizer's checkpoint gathers and background saves use gloo groups, which are made
    anyway."""

    ddp_bucket_size: int | None = None
    """Parameters per gradient bucket (default max(4e7, 1e6 x DP) when overlapping)."""

    ddp_average_in_collective: bool = False
    """Average gradients inside the collective instead of pre-scaling them."""

    use_torch_fsdp2: bool = False
    """Shard params, grads and optimizer state over data-parallel ranks with PyTorch FSDP2."""

    torch_fsdp2_reshard_after_forward: bool = flag(True, names=("--torch-fsdp2-no-reshard-after-forward",))
    """With --use-torch-fsdp2: keep each layer's params gathered from forward to backward (ZeRO-2)."""

    use_megatron_fsdp: bool = False
    """Shard over data-parallel ranks as --data-parallel-sharding-strategy says."""

    data_parallel_sharding_strategy: str = flag(
        "optim_grads_params", choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    """With --use-megatron-fsdp, what is sharded: nothing, optimizer state (ZeRO-1), + grads (ZeRO-2), + params
    (ZeRO-3)."""

    megatron_fsdp_main_params_dtype: str = flag("fp32", choices=("fp32", "bf16", "fp16", "auto"))
    """With --use-megatron-fsdp: dtype of the main params the optimizer updates (auto: the model's). Only
    fp32 is built."""

    megatron_fsdp_main_grads_dtype: str = flag("auto", choices=("fp32", "bf16", "fp16", "auto"))
    """With --use-megatron-fsdp: dtype the gradients are accumulated in (auto: as built here, fp32 where the
    params are sharded, else the reduction's dtype)."""

    megatron_fsdp_grad_comm_dtype: str = flag("auto", choices=("fp32", "bf16", "fp16", "auto"))
    """With --use-megatron-fsdp: dtype the gradients are reduced in (auto: the main grads'); fp32 unless
    --grad-reduce-in-bf16."""

    outer_dp_sharding_strategy: str = flag("no_shard", choices=("no_shard", "optim"))
    """Megatron-LM: what the outer data-parallel dimension of hybrid sharding (Megatron-FSDP with
    --num-distributed-optimizer-instances > 1) shards: nothing, or the optimizer state too. Here sharding is
    over the whole data-parallel group (one instance), which optim asks for."""

    gradient_accumulation_fusion: bool = flag(True, names=("--no-gradient-accumulation-fusion",))
    """Do not fuse weight-gradient accumulation into the fp32 main_grad buffer."""

    use_tp_pp_dp_mapping: bool = False
    """Order ranks tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp."""

    distributed_backend: str = flag("nccl", choices=("nccl", "gloo"))
    """torch.distributed backend."""

    distributed_timeout_minutes: int = 10
    """Timeout of torch.distributed collectives."""

    nccl_communicator_config_path: str | None = None
    """YAML file of NCCL communicator settings per process group (min_ctas, max_ctas, cga_cluster_size,
    net_name, is_high_priority_stream), by Megatron-Core's group names (dp, dp_cp, tp, ...)."""

    high_priority_stream_groups: list[str] = flag(default_factory=list, nargs="+")
    """Process groups (Megatron-Core's names) whose NCCL communicators run on high-priority streams."""

    # torch.distributed.launch passes --local_rank; torchrun sets LOCAL_RANK.
    local_rank: int = flag(default_factory=_launcher_local_rank, names=("--local-rank", "--local_rank"))
    """Local rank from the launcher (default: LOCAL_RANK)."""

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: the ranks of one model replica."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def layout(self) -> str:
        """'TP 4 x PP 1 x CP 1', for messages."""
        return (f"TP {self.tensor_model_parallel_size} x PP {self.pipeline_model_parallel_size} "
                f"x CP {self.context_parallel_size}")

    def data_parallel_size(self, world_size: int) -> int | None:
        """world size / (TP x PP x CP); None when the sizes are not positive or do not divide the world."""
        if self.size_problems() or world_size % self.model_parallel_size:
            return None
        return world_size // self.model_parallel_size

    @property
    def effective_sequence_parallel(self) -> bool:
        """Megatron turns sequence parallelism off at TP = 1, so that the numerics do not change."""
        return self.sequence_parallel and self.tensor_model_parallel_size != 1

    @property
    def effective_expert_tensor_parallel_size(self) -> int:
        """--expert-tensor-parallel-size, by default TP."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    def derived(self) -> dict:
        return {"transformer_pipeline_model_parallel_size": self.pipeline_model_parallel_size,
                "expert_tensor_parallel_size": self.effective_expert_tensor_parallel_size,
                "sequence_parallel": self.effective_sequence_parallel, **self._megatron_fsdp_values(),
                "high_priority_stream_groups": self._high_priority_stream_groups(),
                **{name: _MEGATRON_FSDP_DTYPES.get(getattr(self, name), getattr(self, name))
                   for name in _MEGATRON_FSDP_DTYPE_FIELDS}}

    def _high_priority_stream_groups(self) -> list[str]:
        """--high-priority-stream-groups, plus what Megatron-LM adds for FSDP: the data-parallel group dp_cp gets
        high-priority streams, so that the collectives overlapped with compute are scheduled first. Its condition
        reads `use_torch_fsdp2 or use_megatron_fsdp and arch >= 10`: always with --use-torch-fsdp2, with
        --use-megatron-fsdp from Blackwell (compute capability 10) on. (It adds ep_dp with expert parallelism,
        which FSDP refuses here.)"""
        groups = list(self.high_priority_stream_groups)
        fsdp = self.use_torch_fsdp2 or (self.use_megatron_fsdp and torch.cuda.is_available()
                                        and torch.cuda.get_device_capability()[0] >= 10)
        if fsdp and "dp_cp" not in groups:
            groups.append("dp_cp")
        return groups

    def _megatron_fsdp_values(self) -> dict:
        """--use-megatron-fsdp's strategy decides the optimizer: the distributed one for `optim` (as Megatron-LM
        turns it on), `optim_grads` and `optim_grads_params` (sharded gradients, and params, on DDP's buffers),
        none with no_shard, which gathers no params either (its gradient all-reduce overlaps)."""
        if not self.use_megatron_fsdp:
            return {}
        strategy = self.data_parallel_sharding_strategy
        values = {"use_distributed_optimizer": strategy != "no_shard"}
        if strategy in ("optim_grads", "optim_grads_params"):
            values["overlap_grad_reduce"] = True  # its gradients are reduce-scattered in every backward
        if strategy == "optim_grads_params":
            values["overlap_param_gather"] = True  # the next layer's params are prefetched, as Megatron-FSDP
        if strategy == "no_shard":
            values["overlap_param_gather"] = False
        return values

    def size_problems(self) -> list[str]:
        return [f"{flag_name} {size} must be at least 1" for flag_name, size in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
            ("--context-parallel-size", self.context_parallel_size),
            ("--expert-model-parallel-size", self.expert_model_parallel_size),
        ) if size < 1]

    def pipeline_flag_problems(self) -> list[str]:
        """At most one way of asking for virtual stages / a layout, with positive counts."""
        given = [flag_name for flag_name, value in (
            ("--num-layers-per-virtual-pipeline-stage", self.num_layers_per_virtual_pipeline_stage),
            ("--num-virtual-stages-per-pipeline-rank", self.num_virtual_stages_per_pipeline_rank),
            ("--pipeline-model-parallel-layout", self.pipeline_model_parallel_layout),
        ) if value is not None]
        if len(given) > 1:
            return [f"give at most one of {', '.join(given)}"]
        for flag_name, value in (
                ("--num-layers-per-virtual-pipeline-stage", self.num_layers_per_virtual_pipeline_stage),
                ("--num-virtual-stages-per-pipeline-rank", self.num_virtual_stages_per_pipeline_rank),
                ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
                ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers)):
            if value is not None and value < 1:
                return [f"{flag_name} {value} must be positive"]
        uneven = self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None
        if self.num_layers_per_virtual_pipeline_stage is not None and uneven:
            return ["with --decoder-first/last-pipeline-num-layers give the virtual stages as "
                    "--num-virtual-stages-per-pipeline-rank"]
        return []

    def validate(self) -> list[str]:
        problems = self.size_problems()
        if self.pipeline_model_parallel_size >= 1:
            problems += self.pipeline_flag_problems()
        if self.tp_comm_overlap and not self.effective_sequence_parallel:
            problems.append("--tp-comm-overlap needs --sequence-parallel (with --tensor-model-parallel-size > 1)")
        if self.overlap_param_gather:
            if not (self.use_distributed_optimizer or self.use_megatron_fsdp):
                problems.append("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)")
            if not self.overlap_grad_reduce:
                problems.append("--overlap-param-gather needs --overlap-grad-reduce")
        problems += self._fsdp_problems()
        try:
            load_communicator_settings(self.nccl_communicator_config_path, self.high_priority_stream_groups)
        except ValueError as error:
            problems.append(str(error))
        if self.effective_expert_tensor_parallel_size < 1:
            problems.append(f"--expert-tensor-parallel-size {self.effective_expert_tensor_parallel_size} must be at "
                            "least 1")
        return problems + self._context_parallel_problems()

    def _fsdp_problems(self) -> list[str]:
        """FSDP flags among themselves (with the rest of the run: validate_fsdp.py)."""
        if self.use_torch_fsdp2 and self.use_megatron_fsdp:
            return ["--use-torch-fsdp2 and --use-megatron-fsdp are two implementations of FSDP: choose one"]
        problems = []
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            problems.append("--use-torch-fsdp2 shards the optimizer state itself: drop --use-distributed-optimizer")
        return problems

    def _context_parallel_problems(self) -> list[str]:
        """--cp-comm-type and its hierarchical sizes (the per-layer count is checked with the model's layers)."""
        problems = []
        cp, hierarchical = self.context_parallel_size, self.hierarchical_context_parallel_sizes
        if hierarchical and math.prod(hierarchical) != cp:
            problems.append(f"--hierarchical-context-parallel-sizes {hierarchical} multiply to "
                            f"{math.prod(hierarchical)}, not --context-parallel-size {cp}")
        if "a2a+p2p" in self.cp_comm_type and not hierarchical:
            problems.append("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
        if cp == 1:
            return problems
        # Imported here: the context-parallel attention loads the model code, which parsing alone does not need.
        from megatron.core.transformer.context_parallel.context_parallel_attention import (
            CP_COMM_TYPES,
            CP_COMM_TYPES_NOT_YET,
            canonical_cp_comm_type,
        )

        for name in dict.fromkeys(self.cp_comm_type):
            if canonical_cp_comm_type(name) in CP_COMM_TYPES_NOT_YET:
                problems.append(f"--cp-comm-type {name} is not supported yet; use p2p (ring) or allgather")
            elif canonical_cp_comm_type(name) not in CP_COMM_TYPES:
                problems.append(f"--cp-comm-type {name} is not one of p2p, allgather, a2a, a2a+p2p")
        return problems
