"""The scaling state of one FP8 GEMM, its step-end update, and where it goes in checkpoints.

Operands, one column each: X (input), W (weight), dY (output gradient). With the delayed recipe the state
is one fp32 tensor `meta` [1 + L, 3] (L = amax_history_len):

    row 0          scale of each operand: q = saturate(x * scale)
    rows 1 .. L    Transformer Engine's amax_history [L, 3]: row 1 is the running max |x| of this step,
                   rows 2 .. L the previous steps' amaxes, oldest first (row L the last step's)

During a step every quantization of an operand uses the same scale and folds its amax into row 1 with a
max, so several microbatches, a pipeline schedule and activation recomputation (which repeats a forward
exactly) all give the same result. After the step's last backward `update_fp8_scaling` does, for all
GEMMs at once (Transformer Engine's `_default_get_amax_and_update_history` and `_default_sf_compute`):

    row 1    <- max of row 1 over the tensor x data x context-parallel group (one all-reduce)
    amax      = row 1 ("most_recent") or the max of rows 1 .. L ("max")
    scale     = fp8_max / amax / 2^margin where amax > 0 and finite, else the old scale
    rows 1..L <- rows 2..L, row 1 (TE's roll by -1), then row 1 <- 0

After the reduction the state is the same on every rank of that group, and the same whatever the tensor-
parallel size (the max over the shards of a tensor is the max of the whole tensor). The first step uses
scale 1 (TE's initial state). Evaluation (module in eval mode) quantizes with the current scales and
records nothing, so a run with or without evaluation trains the same.

On a GPU with Triton the quantizations run in triton_quantize.py (one launch writes q, q^T, the inverse
scale and folds the amax into row 1 on the device); elsewhere in quantize.py's functions. Both give the
same bits. The inverse scales live in a small buffer of this module that each launch rewrites, so no call
creates tensors besides its outputs, and nothing waits for the host.

Weights are quantized once per step (`quantize_weight`): the first use after the step-end update writes
q_W [N, K] for the forward GEMMs and q_W^T [K, N] for the dX GEMMs in one pass (recording W's amax), and
every microbatch, recomputed forward and backward of the step reuses them. Memory: 2 bytes per FP8
parameter, held from the first forward to the step-end update, which frees them before the optimizer step;
the price of reading each weight once per step instead of twice per microbatch. The copies are dropped and
redone when the weight may have changed: at `update_fp8_scaling` (every step's end, before the optimizer
writes the weights: a fused optimizer or a parameter all-gather writes them without autograd seeing it,
so autograd's version counter alone would miss it), at a checkpoint load into the layer, at a device move,
and whenever the weight is another tensor or its version counter says it was written in place since (a
`load_state_dict`, a torch optimizer or an edit under no_grad between two updates). The tensorwise recipe
keeps its weights the same way (their scale depends on the weight only).

FP8 parameters (params.py, `fp8_param`): the weight itself is stored in FP8; `quantize_weight` then hands it
out as it is (with its own inverse scale `weight_scale_inv`) and only makes q_W^T once per step, and the
weight's amax is recorded when the weight is written (`weight_written`), not at its first use.

Checkpoints: the linear layer that owns the GEMM saves `meta` as `<layer>._extra_state` (the key Transformer
Engine's modules use for their FP8 metadata) in both --ckpt-format torch and torch_dist (a tensor replicated
over TP and DP), and restores it, so a resumed run is exact. A run without FP8 (or with the tensorwise
recipe, which keeps no state) ignores a saved state; an FP8 run loading a checkpoint without one starts
from scale 1, as Transformer Engine does. An FP8 parameter is saved as its value in high precision and
loaded by a cast with the restored scale (params.py).
"""

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fp8.params import FP8_PARAM_DTYPE, dequantize_fp8_param, is_fp8_param, load_fp8_weight
from megatron.core.fp8.quantize import (
    FP8_MAX,
    Fp8Tensor,
    exact_reciprocal,
    quantize_current,
    quantize_current_and_transpose,
    quantize_transposed,
    quantize_with_amax,
    quantize_with_amax_and_transpose,
    scale_from_amax,
)
from megatron.core.fp8.recipe import GEMM_ALIGNMENT, Fp8Recipe
from megatron.core.fp8.triton_quantize import quantize_fused, runs_in_triton

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
EXTRA_STATE_KEY = "_extra_state"


class _QuantizedWeight(NamedTuple):
    """A weight's quantization for one step, and what it was made from."""

    weight: torch.Tensor
    data_ptr: int
    version: int
    recorded: bool  # its amax is in the scaling state's running amax
    quantized: Fp8Tensor  # `transposed` is q_W^T [K, N], or None if not asked for


class Fp8Scaling(torch.nn.Module):
    """Quantizes the operands of one GEMM (see the module docstring); held by a parallel linear layer."""

    def __init__(self, recipe: Fp8Recipe, device: torch.device):
        super().__init__()
        self.recipe = recipe
        self.dtypes = (recipe.forward_dtype, recipe.forward_dtype, recipe.backward_dtype)
        if recipe.delayed:
            meta = torch.zeros(1 + recipe.amax_history_len, 3, dtype=torch.float32, device=device)
            meta[0] = 1.0
            self.register_buffer("meta", meta, persistent=False)  # saved as the owner's _extra_state
        else:
            self.meta = None
        # Set by params.store_weight_in_fp8 when the layer's weight is an FP8 parameter:
        self.weight_dtype = None  # the dtype the FP8 weight stands for
        self.weight_scale_inv = None  # fp32 0-dim: W = q * weight_scale_inv (its own allocation, 16-byte aligned)
        self.initial_weight = None  # W at construction, until an optimizer makes its main param from it
        self._bind_state()

    def _bind_state(self) -> None:
        """Per-operand views of the state (made once: indexing per call costs host time), the inverse-scale
        buffer the Triton kernels write, and no quantized weight."""
        self._weight = None
        if self.meta is None:
            return
        self._scales, self._amaxes = self.meta[0].unbind(), self.meta[1].unbind()
        # One allocation each: cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) an FP8 GEMM whose scale pointer
        # is not 16-byte aligned, which the 2nd and 3rd elements of one tensor are not.
        self._scale_invs = tuple(torch.ones((), dtype=torch.float32, device=self.meta.device) for _ in range(3))

    def quantize(self, x: torch.Tensor, operand: int, record: bool, transpose: bool = False) -> Fp8Tensor:
        """`x` [rows, columns] in the FP8 dtype of `operand` (INPUT, WEIGHT or GRAD_OUTPUT), with its padded
        transpose if `transpose` (quantize.py); with `record`, its amax goes into this step's history row."""
        dtype = self.dtypes[operand]
        if not self.recipe.delayed:
            current = quantize_current_and_transpose if transpose else quantize_current
            data, transposed, scale, scale_inv = current(x, dtype, self.recipe.margin)
            return Fp8Tensor(data, scale, scale_inv, transposed)
        scale = self._scales[operand]
        if runs_in_triton(x):
            scale_inv = self._scale_invs[operand]
            data, transposed = quantize_fused(x, scale, scale_inv, dtype,
                                              transpose_padding=GEMM_ALIGNMENT if transpose else None,
                                              amax=self._amaxes[operand] if record else None)
            return Fp8Tensor(data, scale, scale_inv, transposed)
        delayed = quantize_with_amax_and_transpose if transpose else quantize_with_amax
        data, transposed, scale_inv, amax = delayed(x, scale, dtype)
        if record:
            running = self._amaxes[operand]
            torch.maximum(running, amax, out=running)
        return Fp8Tensor(data, scale, scale_inv, transposed)

    def quantize_weight(self, weight: torch.Tensor, record: bool, transpose: bool) -> Fp8Tensor:
        """q_W [N, K] of `weight` [N, K], with q_W^T [K, N] if `transpose`: this step's copies if they fit the
        request, else made now in one pass (module docstring). An FP8 parameter is its own q_W."""
        if self.weight_dtype is not None:
            return self._stored_weight(weight, transpose)
        held = self._weight
        if (held is None or held.weight is not weight or held.version != weight._version
                or held.data_ptr != weight.data_ptr() or (record and not held.recorded)
                or (transpose and held.quantized.transposed is None)):
            held = self._weight = _QuantizedWeight(weight, weight.data_ptr(), weight._version,
                                                   record or not self.recipe.delayed,
                                                   self._quantize_weight(weight, record, transpose))
        return held.quantized

    def _quantize_weight(self, weight: torch.Tensor, record: bool, transpose: bool) -> Fp8Tensor:
        dtype = self.dtypes[WEIGHT]
        if self.recipe.delayed and runs_in_triton(weight):
            scale = self._scales[WEIGHT]
            scale_inv = torch.empty_like(scale)  # its own, as the copies it goes with live all step
            data, transposed = quantize_fused(weight, scale, scale_inv, dtype,
                                              transpose_padding=1 if transpose else None,
                                              amax=self._amaxes[WEIGHT] if record else None)
            return Fp8Tensor(data, scale, scale_inv, transposed)
        quantized = self.quantize(weight, WEIGHT, record)
        if transpose:
            quantized = quantized._replace(transposed=quantize_transposed(weight, quantized.scale, dtype))
        return quantized

    def _stored_weight(self, weight: torch.Tensor, transpose: bool) -> Fp8Tensor:
        """The FP8 parameter as q_W (no scale: it is not cast here), with this step's q_W^T if asked for."""
        if weight.dtype != FP8_PARAM_DTYPE:
            raise ValueError(f"this FP8 GEMM stores its weight in FP8, but was given a {weight.dtype} weight")
        held = self._weight
        if (held is None or held.data_ptr != weight.data_ptr() or held.version != weight._version
                or (transpose and held.quantized.transposed is None)):
            data = weight.detach()  # not the Parameter, which points back at this module
            transposed = data.t().contiguous() if transpose else None
            held = self._weight = _QuantizedWeight(None, weight.data_ptr(), weight._version, True,
                                                   Fp8Tensor(data, None, self.weight_scale_inv, transposed))
        return held.quantized

    def weight_write_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale a new value of the FP8 weight is cast with, `amax` its max |W| (0-dim fp32): the weight's
        current scale (delayed), or the scale from `amax` (tensorwise, 1 for a zero weight)."""
        if self.recipe.delayed:
            return self._scales[WEIGHT]
        return scale_from_amax(amax, FP8_MAX[self.dtypes[WEIGHT]], self.recipe.margin, torch.ones_like(amax))

    def weight_written(self, scale: torch.Tensor, amax: torch.Tensor) -> None:
        """The FP8 weight now holds saturate(W * `scale`), W of max |W| `amax`: its inverse scale follows, and
        (delayed) `amax` becomes this step's running amax of the weight, where the first forward of a bf16
        weight puts it (replacing a value recorded before: the weight was written anew)."""
        self.weight_scale_inv.copy_(exact_reciprocal(scale))
        if self.recipe.delayed:
            self._amaxes[WEIGHT].copy_(amax)
        self.drop_quantized_weight()

    def drop_quantized_weight(self) -> None:
        """Forget this step's q_W and q_W^T (the next use quantizes the weight again)."""
        self._weight = None

    def _apply(self, fn, recurse=True):
        """Device moves apply to `meta` and `weight_scale_inv`; dtype casts (Float16Module's `.to(bfloat16)`) do
        not: scales and amaxes stay fp32. The dtype an FP8 weight stands for and its kept initial weight follow
        both, as a bf16 weight would."""
        if self.meta is not None:
            self.meta = self.meta.to(device=fn(torch.empty(0, device=self.meta.device)).device)
        if self.weight_dtype is not None:
            device = self.weight_scale_inv.device
            self.weight_scale_inv = self.weight_scale_inv.to(device=fn(torch.empty(0, device=device)).device)
            self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype, device=device)).dtype
            if self.initial_weight is not None:
                self.initial_weight = fn(self.initial_weight)
        self._bind_state()
        return self

    def extra_repr(self) -> str:
        stored = f"; weight stored in FP8 (for {self.weight_dtype})" if self.weight_dtype is not None else ""
        return self.recipe.describe() + stored


def fp8_scalings(model_chunks: list) -> list:
    """The `Fp8Scaling` of every FP8 GEMM in `model_chunks`, in module order."""
    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, Fp8Scaling)]


def _amax_reduction_group():
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return group if dist.get_world_size(group) > 1 else None


@functools.cache
def _fp8_maxima(dtypes: tuple, device: torch.device) -> torch.Tensor:
    """[3] the largest value of each operand's FP8 format, made once: a copy from the host is not allowed
    while the step is captured in a CUDA graph."""
    return torch.tensor([FP8_MAX[dtype] for dtype in dtypes], device=device)


@torch.no_grad()
def update_fp8_scaling(model_chunks: list) -> None:
    """The step-end update of every delayed-scaling state in `model_chunks` (module docstring), batched:
    a fixed number of kernels and one all-reduce whatever the number of layers. Collective over the
    tensor x data x context-parallel group; call it after the step's last backward, on every rank. It also
    drops the step's quantized weights (the optimizer is about to change the weights, the scales change)."""
    scalings = fp8_scalings(model_chunks)
    for scaling in scalings:
        scaling.drop_quantized_weight()
    scalings = [scaling for scaling in scalings if scaling.meta is not None]
    if not scalings:
        return
    recipe = scalings[0].recipe
    if any(scaling.recipe != recipe for scaling in scalings):
        raise ValueError("update_fp8_scaling: the model's FP8 GEMMs use different recipes")
    metas = torch.stack([scaling.meta for scaling in scalings])  # [S, 1 + L, 3]
    history = metas[:, 1:]  # [S, L, 3]
    group = _amax_reduction_group()
    if group is not None:
        running = history[:, 0].contiguous()
        dist.all_reduce(running, op=dist.ReduceOp.MAX, group=group)
        history[:, 0] = running
    amax = history[:, 0] if recipe.amax_compute_algo == "most_recent" else history.amax(dim=1)  # [S, 3]
    fp8_max = _fp8_maxima(scalings[0].dtypes, metas.device)
    metas[:, 0] = scale_from_amax(amax, fp8_max, recipe.margin, metas[:, 0])
    metas[:, 1:] = history.roll(-1, dims=1)
    metas[:, 1] = 0.0
    torch._foreach_copy_([scaling.meta for scaling in scalings], list(metas.unbind(0)))


def save_fp8_extra_state(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook of a linear layer: its delayed-scaling state as `<prefix>_extra_state`, and an FP8
    weight as its value in high precision (left as the live parameter in a `keep_vars=True` state dict)."""
    scaling = module.fp8
    if scaling is None:
        return
    if scaling.meta is not None:
        state_dict[prefix + EXTRA_STATE_KEY] = scaling.meta
    weight = state_dict.get(prefix + "weight")
    if is_fp8_param(module.weight) and weight is not None and weight is not module.weight:
        state_dict[prefix + "weight"] = dequantize_fp8_param(module.weight)


def load_fp8_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """Load pre-hook of a linear layer: takes `<prefix>_extra_state` out of `state_dict` and restores the
    layer's scaling state from it (see the module docstring for the cases without one); then casts a
    high-precision weight into an FP8 weight with the restored scale (its entry becomes the cast bytes)."""
    saved = state_dict.pop(prefix + EXTRA_STATE_KEY, None)
    scaling = module.fp8
    if scaling is None:
        return
    scaling.drop_quantized_weight()  # the weight is being loaded too
    if saved is not None and scaling.meta is not None:
        _restore_meta(scaling, saved, prefix, error_msgs)
    weight = state_dict.get(prefix + "weight")
    if (is_fp8_param(module.weight) and isinstance(weight, torch.Tensor) and weight.dtype != FP8_PARAM_DTYPE
            and weight.shape == module.weight.shape):
        load_fp8_weight(module.weight, weight)
        state_dict[prefix + "weight"] = module.weight.detach()


def _restore_meta(scaling: Fp8Scaling, saved, prefix: str, error_msgs: list) -> None:
    if not isinstance(saved, torch.Tensor) or saved.shape != scaling.meta.shape:
        shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        error_msgs.append(
            f"{prefix}{EXTRA_STATE_KEY}: saved FP8 scaling state {shape} does not fit this run's "
            f"{tuple(scaling.meta.shape)} = (1 + fp8_amax_history_len {scaling.recipe.amax_history_len}, 3)"
        )
        return
    with torch.no_grad():
        scaling.meta.copy_(saved)
