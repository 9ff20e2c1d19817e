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

Checkpoints: the linear layer that owns the GEMM saves `meta` as `<layer>._extra_state` (the key Transformer
Engine's modules use for their FP8 metadata) in both --ckpt-format torch and torch_dist (a tensor replicated
over TP and DP), and restores it, so a resumed run is exact. A run without FP8 (or with the tensorwise
recipe, which keeps no state) ignores a saved state; an FP8 run loading a checkpoint without one starts
from scale 1, as Transformer Engine does.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fp8.quantize import (
    FP8_MAX,
    Fp8Tensor,
    quantize_current,
    quantize_current_and_transpose,
    quantize_with_amax,
    quantize_with_amax_and_transpose,
    scale_from_amax,
)
from megatron.core.fp8.recipe import Fp8Recipe

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
EXTRA_STATE_KEY = "_extra_state"


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

    def quantize(self, x: torch.Tensor, operand: int, record: bool, transpose: bool = False) -> Fp8Tensor:
        """`x` [rows, columns] in the FP8 dtype of `operand` (INPUT, WEIGHT or GRAD_OUTPUT), with its padded
        transpose if `transpose` (quantize.py); with `record`, its amax goes into this step's history row."""
        dtype = self.dtypes[operand]
        if not self.recipe.delayed:
            current = quantize_current_and_transpose if transpose else quantize_current
            data, transposed, scale, scale_inv = current(x, dtype, self.recipe.margin)
            return Fp8Tensor(data, scale, scale_inv, transposed)
        scale = self.meta[0, operand]
        delayed = quantize_with_amax_and_transpose if transpose else quantize_with_amax
        data, transposed, scale_inv, amax = delayed(x, scale, dtype)
        if record:
            running = self.meta[1, operand]
            torch.maximum(running, amax, out=running)
        return Fp8Tensor(data, scale, scale_inv, transposed)

    def _apply(self, fn, recurse=True):
        """Device moves apply to `meta`; dtype casts (Float16Module's `.to(bfloat16)`) do not: scales and
        amaxes stay fp32."""
        if self.meta is not None:
            target = fn(torch.empty(0, device=self.meta.device))
            self.meta = self.meta.to(device=target.device)
        return self

    def extra_repr(self) -> str:
        return self.recipe.describe()


def fp8_scalings(model_chunks: list) -> list:
    """The delayed-scaling states of every FP8 GEMM in `model_chunks`, in module order."""
    return [module for chunk in model_chunks for module in chunk.modules()
            if isinstance(module, Fp8Scaling) and module.meta is not None]


def _amax_reduction_group():
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return group if dist.get_world_size(group) > 1 else None


@torch.no_grad()
def update_fp8_scaling(model_chunks: list) -> None:
    """The step-end update of every delayed-scaling state in `model_chunks` (module docstring), batched:
    a fixed number of kernels and one all-reduce whatever the number of layers. Collective over the
    tensor x data x context-parallel group; call it after the step's last backward, on every rank."""
    scalings = fp8_scalings(model_chunks)
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
    fp8_max = torch.tensor([FP8_MAX[dtype] for dtype in scalings[0].dtypes], device=metas.device)
    metas[:, 0] = scale_from_amax(amax, fp8_max, recipe.margin, metas[:, 0])
    metas[:, 1:] = history.roll(-1, dims=1)
    metas[:, 1] = 0.0
    torch._foreach_copy_([scaling.meta for scaling in scalings], list(metas.unbind(0)))


def save_fp8_extra_state(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook of a linear layer: its delayed-scaling state as `<prefix>_extra_state`."""
    scaling = module.fp8
    if scaling is not None and scaling.meta is not None:
        state_dict[prefix + EXTRA_STATE_KEY] = scaling.meta


def load_fp8_extra_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """Load pre-hook of a linear layer: takes `<prefix>_extra_state` out of `state_dict` and restores the
    layer's scaling state from it (see the module docstring for the cases without one)."""
    saved = state_dict.pop(prefix + EXTRA_STATE_KEY, None)
    scaling = module.fp8
    if saved is None or scaling is None or scaling.meta is None:
        return
    if not isinstance(saved, torch.Tensor) or saved.shape != scaling.meta.shape:
        shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        error_msgs.append(
            f"{prefix}{EXTRA_STATE_KEY}: saved FP8 scaling state {shape} does not fit this run's "
            f"{tuple(scaling.meta.shape)} = (1 + fp8_amax_history_len {scaling.recipe.amax_history_len}, 3)"
        )
        return
    with torch.no_grad():
        scaling.meta.copy_(saved)
