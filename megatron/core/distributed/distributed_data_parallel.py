"""`DistributedDataParallel`: Megatron-Core's DDP over contiguous gradient buffers.

Backward accumulates every parameter's gradient into `param.main_grad` (a view into a flat buffer,
fp32 for bf16 params with `grad_reduce_in_fp32`) and frees `param.grad`, so gradients of several
microbatches add up in place. After the last microbatch `finish_grad_sync()` (called by
`finalize_model_grads`) all-reduces the buffers over data x context parallel ranks, giving each rank

    main_grad = sum over DP x CP ranks r of (1 / (dp x cp)) * g_r        (the mean gradient)

by pre-scaling with 1/(dp x cp) (or averaging in the collective with `average_in_collective`).
Expert-parallel params (`allreduce=False`) have their own buffers, reduced over the expert
data-parallel group with factor edp/(dp x cp) * 1/edp = 1/(dp x cp) as well.
"""

from contextlib import contextmanager
from typing import Dict, List

import torch
import torch.distributed as dist

from .. import parallel_state
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_buffer import _ParamAndGradBuffer


def _accumulate_into_main_grad(param: torch.nn.Parameter) -> None:
    """Post-accumulate-grad hook: main_grad += grad, then free grad."""
    grad = param.grad
    if grad is None:
        return
    # FP32Optimizer points param.grad at main_grad for its step; autograd then accumulates into it
    # in place, and adding it again would double the gradient.
    aliases_main_grad = grad.data_ptr() == param.main_grad.data_ptr()
    # Fused weight-gradient kernels write into main_grad themselves and set grad_added_to_main_grad.
    already_added = param.grad_added_to_main_grad and not getattr(param, "zero_out_wgrad", False)
    if not aliases_main_grad and not already_added:
        param.main_grad.add_(grad)
    param.grad = None


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its params get `main_grad` buffers that `finish_grad_sync` all-reduces.

    `config` is the model's TransformerConfig (read: `calculate_per_token_loss`, and in
    `finalize_model_grads` `sequence_parallel`, `qk_layernorm`, `timers`). `disable_bucketing` puts each
    buffer in one bucket, as do pipeline stages after the first (their reduction is off the critical
    path).
    """

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
    ):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
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

        self.bucket_size = ddp_config.bucket_size
        if disable_bucketing or parallel_state.get_pipeline_model_parallel_rank() > 0:
            self.bucket_size = None

        self.params_with_grad = [param for param in module.parameters() if param.requires_grad]
        param_to_name = {param: name for name, param in module.named_parameters() if param.requires_grad}
        dense_params = [param for param in self.params_with_grad if getattr(param, "allreduce", True)]
        expert_params = [param for param in self.params_with_grad if not getattr(param, "allreduce", True)]
        self.buffers = self._allocate_buffers(dense_params, self.dp_cp_group, dense_scaling, param_to_name)
        self.expert_parallel_buffers = self._allocate_buffers(
            expert_params, self.expert_dp_group, expert_scaling, param_to_name
        )

        self._hook_handles = []
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
            self._hook_handles.append(param.register_post_accumulate_grad_hook(_accumulate_into_main_grad))
        self._grad_sync_enabled = True
        self._grads_reduced = False

    def _allocate_buffers(
        self,
        params: List[torch.nn.Parameter],
        data_parallel_group,
        gradient_scaling_factor: float,
        param_to_name: Dict[torch.nn.Parameter, str],
    ) -> List[_ParamAndGradBuffer]:
        """One buffer per (param dtype, grad dtype), params kept in module order within each."""
        params_by_dtype: Dict[tuple, List[torch.nn.Parameter]] = {}
        for param in params:
            grad_dtype = torch.float if self.ddp_config.grad_reduce_in_fp32 else param.dtype
            params_by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        return [
            _ParamAndGradBuffer(
                self.ddp_config, param_dtype, grad_dtype, dtype_params, data_parallel_group,
                self.bucket_size, param_to_name, gradient_scaling_factor,
            )
            for (param_dtype, grad_dtype), dtype_params in params_by_dtype.items()
        ]

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside; `start_grad_sync` does nothing until the context exits."""
        self._grad_sync_enabled = False
        try:
            yield
        finally:
            self._grad_sync_enabled = True

    def _reduce_all_buffers(self) -> None:
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.all_reduce_gradients()

    def start_grad_sync(self, *unused) -> None:
        """All-reduces the gradients now (a no-op inside `no_sync`); `finish_grad_sync` then only completes."""
        if not self._grad_sync_enabled:
            return
        if self._grads_reduced:
            raise RuntimeError(
                "start_grad_sync was called twice without finish_grad_sync: the gradients would be reduced twice"
            )
        self._reduce_all_buffers()
        self._grads_reduced = True

    def finish_grad_sync(self) -> None:
        """Makes sure the gradients of this iteration are all-reduced exactly once; call before the optimizer."""
        if not self._grads_reduced:
            self._reduce_all_buffers()
        self._grads_reduced = False

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiplies all gradients in the buffers by `scaling_factor`."""
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zeros all gradient buffers; call at the start of every iteration."""
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.reset()
        self._grads_reduced = False

    def broadcast_params(self) -> None:
        """Copies every param from the first rank of its data-parallel group to the others."""
        for param in self.module.parameters():
            group = self.dp_cp_group if getattr(param, "allreduce", True) else self.expert_dp_group
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict (no `module.` prefix), so checkpoints match the bare model."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)
