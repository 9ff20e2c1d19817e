"""`DistributedDataParallel`: Megatron-Core's DDP over contiguous gradient buffers.

Backward accumulates every parameter's gradient into `param.main_grad` (a view into a flat buffer,
fp32 for bf16 params with `grad_reduce_in_fp32`) and frees `param.grad`, so gradients of several
microbatches add up in place. The buffer is not zeroed between steps: `zero_grad_buffer` marks every
param `overwrite_main_grad`, its first gradient of the step is written (copied, or by the weight-gradient
GEMM with beta = 0: fusions/fused_weight_gradient.py) and later ones added, and a param that got none is
zeroed when its bucket is reduced. The buffers are then reduced over the data x context parallel ranks,
giving each rank

    main_grad = sum over DP x CP ranks r of (1 / (dp x cp)) * g_r        (the mean gradient)

by pre-scaling with 1/(dp x cp) (or averaging in the collective with `average_in_collective`); with the
distributed optimizer by a reduce-scatter, after which rank r holds only its shard of the mean.
Expert-parallel params (`allreduce=False`) have their own buffers, reduced over the expert
data-parallel group with factor edp/(dp x cp) * 1/edp = 1/(dp x cp) as well.

When the reduction happens:
    no overlap               `finish_grad_sync()` (from `finalize_model_grads`) reduces every bucket.
    overlap_grad_reduce      during the last microbatch's backward: a bucket's reduction is launched
                             asynchronously by the gradient hook of its last param to receive a gradient;
                             `finish_grad_sync()` waits. Microbatches before the last run under `no_sync()`,
                             which only accumulates.
With the distributed optimizer the optimizer step updates this rank's shard of the param buffer and the
params are all-gathered: at once, or with overlap_param_gather asynchronously, bucket after bucket, each
waited for by the forward pre-hooks of its modules (see param_and_grad_bucket.py).

Weights stored in FP8 (`fp8_param_gather`, megatron/core/fp8/params.py) have buffers of their own: a uint8
param buffer (one byte per element, so their all-gather moves half of bf16's bytes) and a grad buffer of
the dtype they stand for (or fp32), which their FP8 GEMMs write directly.
"""

import logging
import weakref
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import parallel_state
from ..fp8.params import fp8_param_dtype, fp8_param_tensors, is_fp8_param
from ..fusions.fused_weight_gradient import takes_main_grad
from .data_parallel_base import _BaseDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_buffer import _ParamAndGradBuffer

logger = logging.getLogger(__name__)


def _grad_to_accumulate(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """`param.grad` where it still has to go into main_grad, else None."""
    grad = param.grad
    if grad is None:
        return None
    # FP32Optimizer points param.grad at main_grad for its step; autograd then accumulates into it
    # in place, and adding it again would double the gradient.
    aliases_main_grad = grad.data_ptr() == param.main_grad.data_ptr()
    # Fused weight-gradient kernels write into main_grad themselves and set grad_added_to_main_grad.
    already_added = param.grad_added_to_main_grad and not getattr(param, "zero_out_wgrad", False)
    return None if aliases_main_grad or already_added else grad


def _accumulate_into_main_grad(param: torch.nn.Parameter) -> None:
    """main_grad += grad (main_grad = grad for the step's first: module docstring), then free grad."""
    grad = _grad_to_accumulate(param)
    if grad is not None:
        if takes_main_grad(param):
            param.main_grad.copy_(grad)
        else:
            param.main_grad.add_(grad)
    param.grad = None


class _GradCopies:
    """The gradients of 1-D params (biases, norm weights: ~100 small tensors a step in GPT-2 small) put into
    main_grad together at the end of backward: one multi-tensor copy for those that write main_grad instead
    of a copy kernel each (0.37 ms a step of GPT-2 small's 20 ms on an H100). Additions (later microbatches)
    stay one per tensor: the multi-tensor add takes one dtype only. Only while no bucket is reduced during
    this backward (without overlap_grad_reduce, or inside no_sync); 1-D only, so what is held back is small."""

    def __init__(self):
        self.writes, self.additions = [], []  # (main_grad, grad)
        self.flush_queued = False

    def hold(self, param: torch.nn.Parameter) -> None:
        """Takes `param.grad` (called from its gradient hook, inside backward)."""
        if not self.flush_queued:  # runs once this backward has finished (after every gradient hook)
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.flush_queued = True
        grad = _grad_to_accumulate(param)
        if grad is not None:
            (self.writes if takes_main_grad(param) else self.additions).append((param.main_grad, grad))
        param.grad = None

    def flush(self) -> None:
        """Writes and adds what is held (each param at most once: its hook runs once per backward)."""
        if self.writes:
            mains, grads = zip(*self.writes)
            torch._foreach_copy_(list(mains), list(grads))
        for main_grad, grad in self.additions:
            main_grad.add_(grad)
        self.writes, self.additions, self.flush_queued = [], [], False


def _waits_for(buckets: list):
    """A forward pre-hook that waits for the param gathers of `buckets`."""
    def wait(*unused) -> None:
        for bucket in buckets:
            bucket.wait_param_gather()
    return wait


def default_bucket_size(ddp_config: DistributedDataParallelConfig, data_parallel_size: int):
    """Elements per bucket: Megatron's max(4e7, 1e6 x dp) unless given; one bucket without overlap.

    Without overlap_grad_reduce every bucket is reduced after backward anyway, so Megatron-LM keeps one
    bucket per buffer and ignores `bucket_size` (which also fixes the distributed optimizer's layout).
    """
    if not ddp_config.overlap_grad_reduce:
        return None
    if ddp_config.bucket_size is not None:
        return ddp_config.bucket_size
    return max(40_000_000, 1_000_000 * data_parallel_size)


def _weak_method(method):
    """`method` without a strong reference to its object. A parameter's hook that held this DDP would form a
    cycle (DDP -> module -> param -> hook -> DDP) that the garbage collector does not break (a tensor that C++
    also holds is not traversed), so the model, its buffers and its process groups (with their gloo worker
    threads) would live until interpreter teardown."""
    weak, name = weakref.WeakMethod(method), method.__qualname__  # the closure must not hold `method`

    def call(*args):
        bound = weak()
        if bound is None:
            raise RuntimeError(f"{name} runs for a parameter whose DistributedDataParallel wrapper was freed: "
                               "keep a reference to the wrapper while its module trains")
        return bound(*args)

    return call


class DistributedDataParallel(_BaseDataParallel):
    """Wraps `module`; its params get `main_grad` buffers that are reduced over data-parallel ranks.

    `config` is the model's TransformerConfig (read: `calculate_per_token_loss`, and in
    `finalize_model_grads` `sequence_parallel`, `qk_layernorm`, `timers`). `disable_bucketing` puts each
    buffer in one bucket, as do pipeline stages after the first (their reduction is off the critical
    path).
    """

    buffer_class = _ParamAndGradBuffer  # a subclass may keep its gradients otherwise
    # Megatron-LM's DDP: stages after the first one reduce in one bucket (their reductions overlap other
    # microbatches' work anyway). Megatron-FSDP keeps bucket_size on every stage.
    one_bucket_after_first_stage = True
    # A checkpoint is written from the whole params (gathered first with the distributed optimizer); a subclass
    # may write each rank's shard instead.
    saves_whole_params = True

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
    ):
        super().__init__(config, module)
        self.ddp_config = ddp_config
        calculate_per_token_loss = getattr(config, "calculate_per_token_loss", False)
        if calculate_per_token_loss and ddp_config.average_in_collective:
            raise ValueError(
                "average_in_collective (--ddp-average-in-collective) cannot be used with --calculate-per-token-loss: "
                "the gradients are divided by the global token count instead"
            )

        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        dp_cp_size = dist.get_world_size(self.dp_cp_group)
        expert_dp_size = dist.get_world_size(self.expert_dp_group)
        if calculate_per_token_loss:
            dense_scaling, expert_scaling = 1.0, 1.0
        elif ddp_config.average_in_collective:
            dense_scaling, expert_scaling = 1.0, expert_dp_size / dp_cp_size
        else:
            dense_scaling, expert_scaling = 1.0 / dp_cp_size, 1.0 / dp_cp_size

        if ddp_config.bucket_size is not None and not ddp_config.overlap_grad_reduce:
            logger.warning("bucket_size (--ddp-bucket-size) only acts with overlap_grad_reduce "
                           "(--overlap-grad-reduce): using one bucket per buffer, as Megatron-LM does")
        self.bucket_size = default_bucket_size(ddp_config, parallel_state.get_data_parallel_world_size())
        later_stage = parallel_state.get_pipeline_model_parallel_rank() > 0
        if disable_bucketing or (later_stage and self.one_bucket_after_first_stage):
            self.bucket_size = None

        self.params_with_grad = [param for param in module.parameters() if param.requires_grad]
        if any(is_fp8_param(param) for param in self.params_with_grad) and not ddp_config.fp8_param_gather:
            raise ValueError(
                "the model stores weights in FP8 (TransformerConfig.fp8_param): wrap it with "
                "DistributedDataParallelConfig(fp8_param_gather=True) (--fp8-param-gather sets both)"
            )
        self.param_to_name = {param: name for name, param in module.named_parameters() if param.requires_grad}
        dense_params = [param for param in self.params_with_grad if getattr(param, "allreduce", True)]
        expert_params = [param for param in self.params_with_grad if not getattr(param, "allreduce", True)]
        self.buffers = self._allocate_buffers(dense_params, self.dp_cp_group, dense_scaling)
        self.expert_parallel_buffers = self._allocate_buffers(expert_params, self.expert_dp_group, expert_scaling)
        self.param_to_bucket = {
            param: bucket
            for buffer in self.buffers + self.expert_parallel_buffers
            for param, bucket in buffer.param_to_bucket.items()
        }

        self._grad_sync_enabled = True
        self._grad_copies = _GradCopies()
        self._hook_handles = []
        gradient_hook = _weak_method(self._gradient_hook)
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
            self._hook_handles.append(param.register_post_accumulate_grad_hook(gradient_hook))
        self.use_forward_hook = ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather
        self._forward_pre_hook_handles = []
        if self.use_forward_hook:
            self.enable_forward_pre_hook()

    def _allocate_buffers(
        self, params: List[torch.nn.Parameter], data_parallel_group, gradient_scaling_factor: float
    ) -> List[_ParamAndGradBuffer]:
        """One buffer per (param dtype, grad dtype), params kept in module order within each; FP8 weights in
        buffers of param dtype uint8 (their bytes), their gradients in the dtype they stand for."""
        params_by_dtype: Dict[tuple, List[torch.nn.Parameter]] = {}
        for param in params:
            param_dtype, value_dtype = param.dtype, param.dtype
            if is_fp8_param(param):
                param_dtype, value_dtype = torch.uint8, fp8_param_dtype(param)
            grad_dtype = torch.float if self.ddp_config.grad_reduce_in_fp32 else value_dtype
            params_by_dtype.setdefault((param_dtype, grad_dtype), []).append(param)
        return [
            self.buffer_class(
                self.ddp_config, param_dtype, grad_dtype, dtype_params, data_parallel_group,
                self.bucket_size, self.param_to_name, gradient_scaling_factor, self._param_layers(),
            )
            for (param_dtype, grad_dtype), dtype_params in params_by_dtype.items()
        ]

    def _param_layers(self) -> Optional[Dict[torch.nn.Parameter, int]]:
        """{param: its transformer layer} when buckets must hold whole layers (buffer_layout.py); None here:
        buckets are cut by size alone."""
        return None

    @property
    def _all_buffers(self) -> List[_ParamAndGradBuffer]:
        return self.buffers + self.expert_parallel_buffers

    def main_grad_buffers(self) -> List[torch.Tensor]:
        """The contiguous fp32 (or bf16) buffers that hold every parameter's `main_grad` (with padding)."""
        return [buffer.grad_data for buffer in self._all_buffers]

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """What this rank holds of `param`'s data-parallel-reduced gradient, in place (finalize_model_grads
        sums it over the TP ranks or pipeline stages that hold copies of the param): its `main_grad` (with the
        distributed optimizer only this rank's piece of it is reduced, and the copies' owned pieces coincide:
        buffer_layout.py)."""
        return param.main_grad

    def _gradient_hook(self, param: torch.nn.Parameter) -> None:
        """After autograd accumulated `param.grad` (once per backward, however often the param was used)."""
        reducing = self.ddp_config.overlap_grad_reduce and self._grad_sync_enabled
        if param.dim() == 1 and not reducing:
            self._grad_copies.hold(param)
        else:
            _accumulate_into_main_grad(param)
        if reducing:
            self.param_to_bucket[param].register_grad_ready(param, self.param_to_name[param])

    def enable_forward_pre_hook(self) -> None:
        """Registers the pre-hooks that overlap the param all-gathers with forward (overlap_param_gather): each
        module holding params waits for the gathers of their buckets."""
        if not self.use_forward_hook:
            raise ValueError("forward pre-hooks gather params for use_distributed_optimizer with overlap_param_gather")
        if self._forward_pre_hook_handles:
            raise RuntimeError("the forward pre-hooks are enabled already")
        for module in self.module.modules():
            buckets = list({self.param_to_bucket[param]: None for param in module.parameters(recurse=False)
                            if param in self.param_to_bucket})
            if buckets:
                self._forward_pre_hook_handles.append(module.register_forward_pre_hook(_waits_for(buckets)))

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Removes the pre-hooks; with `param_sync` first makes every param whole (before eval or a save)."""
        if not self.use_forward_hook:
            raise ValueError("forward pre-hooks gather params for use_distributed_optimizer with overlap_param_gather")
        for handle in self._forward_pre_hook_handles:
            handle.remove()
        self._forward_pre_hook_handles = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    @contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside; no reduction is launched until the context exits."""
        self._grad_sync_enabled = False
        try:
            yield
        finally:
            self._grad_sync_enabled = True

    def start_grad_sync(self, *unused) -> None:
        """Launches the reduction of every bucket not launched yet (a no-op inside `no_sync`); asynchronous
        with overlap_grad_reduce. `finish_grad_sync` completes it."""
        if not self._grad_sync_enabled:
            return
        self._grad_copies.flush()
        for buffer in self._all_buffers:
            buffer.start_grad_sync(async_op=self.ddp_config.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """Completes this iteration's gradient reduction (each gradient is reduced exactly once per call,
        however much of it backward launched already); call before the optimizer."""
        self._grad_copies.flush()
        for buffer in self._all_buffers:
            buffer.finish_grad_sync()

    def start_param_sync(self, *unused, force_sync: bool = False) -> None:
        """All-gathers the params after a distributed-optimizer step (no-op without one).

        With overlap_param_gather they stay in flight until the next forward's pre-hooks wait for them;
        `force_sync` makes every param whole now instead (waits for the gathers in flight).
        """
        if not self.ddp_config.use_distributed_optimizer:
            return
        for buffer in self._all_buffers:
            if force_sync:
                buffer.complete_param_sync()
            else:
                buffer.start_param_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiplies all gradients in the buffers by `scaling_factor`."""
        for buffer in self._all_buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Empties all gradient buffers (marks them, module docstring); call at the start of every iteration.
        A `.grad` left aliasing `main_grad` (FP32Optimizer's step) is dropped: autograd would add into it."""
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
            param.grad = None
        self._grad_copies = _GradCopies()  # nothing held over from a backward that raised
        for buffer in self._all_buffers:
            buffer.reset()

    def zero_unwritten_grads(self) -> None:
        """Zeroes the gradient of each param that nothing wrote this step, now rather than when its bucket is
        reduced: for a reader of the local gradients before the reduction (the bad-step check), which would
        otherwise see an emptied buffer's stale bytes there."""
        self._grad_copies.flush()
        for buffer in self._all_buffers:
            for bucket in buffer.buckets:
                bucket.zero_unwritten_grads()

    def broadcast_params(self) -> None:
        """Copies every param (a weight stored in FP8 with its scale) from the first rank of its data-parallel
        group to the others."""
        for param in self.module.parameters():
            group = self.dp_cp_group if getattr(param, "allreduce", True) else self.expert_dp_group
            for tensor in fp8_param_tensors(param) if is_fp8_param(param) else [param.data]:
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
