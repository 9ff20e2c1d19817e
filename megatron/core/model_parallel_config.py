"""`ModelParallelConfig`: how a model is split over ranks and in which precision its weights live.

Field names and defaults are Megatron-Core's. `TransformerConfig` extends it; every problem found by
either is reported together in one `ValueError`.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch


def raise_config_problems(config_name: str, problems: list[str]) -> None:
    """Raises one ValueError listing every problem (no-op when there are none)."""
    if problems:
        lines = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(f"{config_name} has {len(problems)} problem(s):\n{lines}")


def reject_unsupported(owner: str, **options) -> None:
    """Raises "owner: name=value is not supported yet" for the first option that is set (truthy)."""
    for name, value in options.items():
        if value:
            raise ValueError(f"{owner}: {name}={value!r} is not supported yet")


def divisors(n: int) -> list[int]:
    """The positive divisors of n, for messages such as "TP must divide 12 heads: 1, 2, 3, 4, 6, 12"."""
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def legal_sizes(n: int) -> str:
    """The divisors of n as text, "1, 2, 3, 4, 6, 12": the legal sizes when something must divide n."""
    return ", ".join(map(str, divisors(n)))


@dataclass
class ModelParallelConfig:
    """Parallel layout, initialisation and precision settings shared by every Megatron-Core model."""

    # --- parallel layout ---------------------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    """Ranks a layer's weights are split over (TP)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layers are split over (PP)."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule (VPP)."""

    sequence_parallel: bool = False
    """Split LayerNorm/dropout/residual activations along the sequence over the TP ranks (needs TP > 1)."""

    tp_comm_overlap: bool = False
    """Fuse the sequence-parallel all-gathers and reduce-scatters of the TP linears with their GEMMs
    (`--tp-comm-overlap`; needs sequence_parallel): megatron/core/tensor_parallel/comm_overlap.py."""

    context_parallel_size: int = 1
    """Ranks the sequence is split over inside attention (CP)."""

    expert_model_parallel_size: int = 1
    """Ranks the MoE experts are split over (EP)."""

    expert_tensor_parallel_size: Optional[int] = None
    """TP size inside experts; defaults to `tensor_model_parallel_size`."""

    # --- initialisation ----------------------------------------------------------------------------------
    perform_initialization: bool = True
    """Run the weight init methods. False leaves weights uninitialised (for loading a checkpoint next)."""

    use_cpu_initialization: bool = False
    """Initialise each full weight with the CPU RNG on every rank, then keep this rank's slice: the
    model is then the same whatever the TP size. Otherwise each shard is drawn on the device from the
    per-TP-rank `model-parallel-rng` stream."""

    # --- precision ---------------------------------------------------------------------------------------
    fp16: bool = False
    """Train with fp16 weights and activations (with `Float16Module` and a loss scaler)."""

    bf16: bool = False
    """Train with bf16 weights and activations (with `Float16Module`)."""

    params_dtype: torch.dtype = torch.float32
    """dtype the parameters are created in."""

    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of the activations sent between pipeline stages; required when PP > 1."""

    enable_autocast: bool = False
    """Run the forward step under `torch.autocast(dtype=autocast_dtype)`."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype for autocast; defaults to `params_dtype`."""

    gradient_accumulation_fusion: bool = False
    """Accumulate the weight gradients of the parallel linear layers straight into DDP's fp32
    `main_grad` inside the GEMM (`--gradient-accumulation-fusion`, megatron/core/fusions)."""

    # --- pipeline schedule -------------------------------------------------------------------------------
    variable_seq_lengths: bool = False
    """Microbatches may differ in sequence length (pipeline stages exchange shapes first)."""

    batch_p2p_comm: bool = True
    """Batch the pipeline send/recv pairs into one `batch_isend_irecv`."""

    overlap_p2p_comm: bool = False
    """Overlap pipeline send/recv with compute (interleaved schedule)."""

    deallocate_pipeline_outputs: bool = False
    """Free a stage's output tensor data once it has been sent (keeps only the autograd graph)."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Microbatches each virtual stage runs in a row in the interleaved schedule; defaults to PP."""

    # --- hooks the training loop installs ----------------------------------------------------------------
    timers: Optional[Callable] = None
    """Timers object used by the schedules."""

    finalize_model_grads_func: Optional[Callable] = None
    """Called after the last backward of a step (grad all-reduce, tied-embedding grad sync)."""

    grad_scale_func: Optional[Callable] = None
    """Multiplies the loss by the loss scale before backward (fp16)."""

    no_sync_func: Optional[Callable] = None
    """Context manager that suspends grad synchronisation during gradient accumulation."""

    grad_sync_func: Optional[Callable] = None
    """Starts the grad reduction of a model chunk (overlap with the pipeline)."""

    param_sync_func: Optional[Callable] = None
    """Starts the param all-gather of a model chunk (distributed optimizer overlap)."""

    def __post_init__(self):
        raise_config_problems(type(self).__name__, self.parallelism_problems())

    def parallelism_problems(self) -> list[str]:
        """Checks the layout and precision fields and fills their derived defaults; returns the problems."""
        problems = []
        sizes = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
        }
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                problems.append(f"{name} must be a positive integer, got {size!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            problems.append(
                "sequence_parallel=True needs tensor_model_parallel_size > 1 (it splits activations over "
                "the TP ranks); got tensor_model_parallel_size=1"
            )
        if self.tp_comm_overlap and not self.sequence_parallel:
            problems.append(
                "tp_comm_overlap=True overlaps the sequence-parallel collectives and needs sequence_parallel=True"
            )
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            problems.append(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} needs pipeline_dtype "
                "(the dtype of the activations sent between stages, e.g. torch.bfloat16)"
            )
        if self.fp16 and self.bf16:
            problems.append("fp16 and bf16 are both True; choose at most one")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        return problems
