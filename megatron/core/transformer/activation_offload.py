"""Fine-grained activation offloading (Megatron-Core's `fine_grained_activation_offloading`): the tensors that
chosen submodules save for their backward pass wait in host memory instead of device memory.

    with self.qkv_offload.scope():               # an ActivationOffload of "qkv_linear"
        query, key, value = self.get_query_key_value_tensors(hidden_states)

Inside the `with`, autograd's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) see every tensor
an operation saves for backward. Each one worth moving (below) is copied to host memory and autograd keeps the
host copy instead: on CUDA into pinned memory, on a side stream that first waits for the compute stream, so
the copy overlaps the following forward work (the device tensor is marked used by that stream, so its memory
is reused only after the copy); on the CPU into a separate host tensor. When backward needs it, it is copied
back (the compute stream first waits for the offload to finish). The values are the same bits, so losses and
gradients equal those of a run without offloading.

Worth moving: at least `min_offloaded_tensor_size` elements, not a parameter or a view of one (they stay
resident anyway), and not saved during backward (a recompute, whose tensors are used at once). What is copied is the memory the tensor spans (a strided view's gaps too), so that the tensor
comes back with its strides and backward runs the very same kernels.

The modules (Megatron-Core's names; each is the boundary of one `with`):
    attn_norm    the attention's input norm          (TransformerLayer.input_layernorm)
    qkv_linear   the query/key/value projections     (linear_qkv, with the q/k norms; MLA's down and up
                                                      projections)
    core_attn    the core attention                  (softmax(QK^T s) V)
    attn_proj    the attention's output projection   (linear_proj)
    mlp_norm     the MLP's input norm                (TransformerLayer.pre_mlp_layernorm)
    expert_fc1   the MoE experts' fc1
    moe_act      the MoE experts' activation
Megatron-Core's "fused_group_mlp" (Transformer Engine's fused grouped MLP) and "gdp_qkv" (Gated DeltaProduct
layers) have no counterpart here and are refused.

What Megatron-Core adds for speed only is not done: it keeps the last groups of a step on the device and
reloads the next group ahead of its backward; here each tensor is reloaded when backward reaches it.
"""

import collections
import contextlib

import torch

from megatron.core.transformer.config_rules import SettingName, field_setting

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
_NOT_BUILT = {
    "fused_group_mlp": "needs Transformer Engine's fused grouped MLP (--use-transformer-engine-op-fuser), which "
                       "is not used here; offload expert_fc1 and moe_act instead",
    "gdp_qkv": "Gated DeltaProduct layers are not built here",
}
_MOE_MODULES = ("expert_fc1", "moe_act")


def offload_module_problems(settings, name: SettingName = field_setting) -> list[str]:
    """Megatron-Core's rules of `fine_grained_activation_offloading` for `settings` (a TransformerConfig or
    the arguments), and what is not built here."""
    problems = []
    if not 0.0 <= settings.activation_offload_fraction <= 1.0:
        problems.append(f"{name('activation_offload_fraction', settings.activation_offload_fraction)} must be in "
                        "[0, 1]")
    elif settings.activation_offload_fraction != 1.0:
        problems.append(f"{name('activation_offload_fraction', settings.activation_offload_fraction)}: offloading "
                        "a fraction of the groups is not supported yet (every group is offloaded)")
    if settings.delta_offload_bytes_across_pp_ranks != 0:
        problems.append(f"{name('delta_offload_bytes_across_pp_ranks', settings.delta_offload_bytes_across_pp_ranks)}"
                        ": balancing the offloaded bytes over pipeline ranks is not supported yet")
    if not getattr(settings, "fine_grained_activation_offloading", False):
        return problems
    modules = list(settings.offload_modules or ())
    if not modules:
        problems.append(f"{name('fine_grained_activation_offloading')} needs {name('offload_modules')}: one or "
                        f"more of {', '.join(OFFLOAD_MODULES)}")
    for module in modules:
        if module in _NOT_BUILT:
            problems.append(f"{name('offload_modules')} entry {module!r}: {_NOT_BUILT[module]}")
        elif module not in OFFLOAD_MODULES:
            problems.append(f"unknown {name('offload_modules')} entry {module!r}; valid: {', '.join(OFFLOAD_MODULES)}")
    if "attn_proj" in modules and "core_attn" not in modules:
        problems.append(f"{name('offload_modules')} 'attn_proj' needs 'core_attn' too (as in Megatron-LM): the "
                        "projection's input is the core attention's output, which its backward needs anyway")
    recomputed_moe = settings.recompute_granularity == "selective" and "moe" in (settings.recompute_modules or ())
    inside_moe = [module for module in _MOE_MODULES if module in modules]
    if recomputed_moe and inside_moe:
        problems.append(f"{name('offload_modules')} {' '.join(inside_moe)} with 'moe' in {name('recompute_modules')}: "
                        "the recomputed MoE layer saves nothing inside it to offload (as in Megatron-LM)")
    if settings.min_offloaded_tensor_size < 0:
        problems.append(f"{name('min_offloaded_tensor_size', settings.min_offloaded_tensor_size)} must be >= 0")
    inflight = settings.fine_grained_offloading_max_inflight_offloads
    if inflight is not None and inflight < 0:
        problems.append(f"{name('fine_grained_offloading_max_inflight_offloads', inflight)} must be >= 0")
    if getattr(settings, "use_torch_compile", False):
        problems.append(f"{name('fine_grained_activation_offloading')} with {name('use_torch_compile')} is not "
                        "supported yet")
    return problems


_SIDE_STREAMS: dict = {}


def _offload_stream(device: torch.device) -> "torch.cuda.Stream":
    """One copy stream per device, shared by every offloading module."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class ActivationOffload:
    """Offloads what autograd saves inside `with offload.scope():`, for the module `name` (module docstring);
    does nothing when the config does not offload `name` (`enabled` False).

    Counts, for tests and logs: `offloaded` tensors and `offloaded_bytes` copied to the host, `reloaded`
    tensors copied back."""

    def __init__(self, config, name: str, enabled: bool = True):
        if name not in OFFLOAD_MODULES:
            raise ValueError(f"unknown offload module {name!r}; valid: {', '.join(OFFLOAD_MODULES)}")
        self.name = name
        self.enabled = bool(enabled and config.fine_grained_activation_offloading
                            and name in (config.offload_modules or ()))
        self.min_numel = config.min_offloaded_tensor_size
        self.max_inflight = config.fine_grained_offloading_max_inflight_offloads
        self.offloaded, self.offloaded_bytes, self.reloaded = 0, 0, 0
        self._last_event, self._inflight = None, collections.deque()

    def scope(self):
        """The context of one forward call of the module: the hooks when enabled, else a null context (which
        torch.compile traces through)."""
        return self._hooked() if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _hooked(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self._limit_inflight()

    def _worth_offloading(self, tensor: torch.Tensor) -> bool:
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward: its tensors are used at once
            return False
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return False
        return tensor.device.type in ("cuda", "cpu") and tensor.numel() >= max(self.min_numel, 1)

    def _pack(self, tensor: torch.Tensor):
        """Copies the memory span the tensor covers (one contiguous copy, gaps of a strided view included) so
        that the reloaded tensor has the same strides: backward kernels then run exactly as without offloading."""
        if not self._worth_offloading(tensor):
            return tensor
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        memory = tensor.as_strided((span,), (1,), tensor.storage_offset())
        event = None
        if tensor.is_cuda:
            stream = _offload_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            host = torch.empty(span, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(memory, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            tensor.record_stream(stream)
            self._last_event = event
        else:
            host = memory.clone()
        self.offloaded += 1
        self.offloaded_bytes += span * tensor.element_size()
        return tensor.device, host, tuple(tensor.shape), tensor.stride(), event

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, shape, stride, event = packed
        self.reloaded += 1
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
            host = host.to(device, non_blocking=True)
        return host.as_strided(shape, stride)

    def _limit_inflight(self) -> None:
        """With `max_inflight` N: after this forward call's offloads, the compute stream waits for all but the
        newest N calls' copies."""
        if self._last_event is None or self.max_inflight is None:
            self._last_event = None
            return
        self._inflight.append(self._last_event)
        self._last_event = None
        while len(self._inflight) > self.max_inflight:
            torch.cuda.current_stream().wait_event(self._inflight.popleft())
