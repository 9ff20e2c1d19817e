"""FP8 parameters (`TransformerConfig.fp8_param`, `--fp8-param-gather`): the weights of the FP8 GEMMs kept in FP8.

The choice: the weight's `nn.Parameter` itself holds the FP8 bytes q (dtype float8_e4m3fn, one byte per
element), and its layer's `Fp8Scaling` holds what gives them their value,

    W = q * weight_scale_inv          (fp32 0-dim)      in `weight_dtype` (bf16 in a --bf16 run)

A plain tensor, not a tensor subclass (Transformer Engine's Float8Tensor, torchao's float8 tensors): DDP's
buffers (a uint8 param buffer, `param.data` a float8 view into it), the distributed optimizer's shards
(views into that buffer), the param all-gather (of the bytes, half of bf16's traffic), autograd's hooks and
gradient clipping (on the fp32 main gradients) treat it as any parameter, and nothing dispatches per op. The
price is that the few places that need W in high precision ask for it here (`dequantize_fp8_param`), and
that W's gradient must not go through autograd, which would cast it to the parameter's dtype: the FP8
linear writes it into DDP's `main_grad` (the fused-accumulation protocol), so FP8 parameters need DDP.

What happens to q, each time the same as what a run without FP8 parameters quantizes at its next forward:

    construction      q = cast(W_init), W_init kept (`initial_weight`) until an optimizer makes its fp32
                      main param from it (Transformer Engine's preserve_high_precision_init_val)
    forward/backward  q is the GEMM operand as is; q^T for the dX GEMM is made once per step (scaling.py)
    optimizer step    q[piece] = cast(main[piece]) for the piece of each weight this data-parallel rank
                      owns, then the param all-gather moves the bytes (distributed optimizer); the plain
                      mixed-precision optimizer casts whole weights
    checkpoint        written as W in `weight_dtype` (the model state dict, torch_dist), read back by a cast;
                      after the optimizer's state is loaded too, its exact main params are cast again
                      (`MegatronOptimizer.refresh_fp8_params`), so a resumed run continues bitwise

    cast(V) = saturate(round_to_weight_dtype(V) * scale) in E4M3; the rounding to bf16 first gives the bytes
              a bf16 weight would give (as Megatron-LM and Transformer Engine do)

Scales: with the delayed recipe a cast uses the weight's current scale and makes the new weight's amax this
step's amax of the weight; with the tensorwise recipe the scale comes from that amax. The amax is the max over
the ranks that each cast a piece (the data-parallel group), one all-reduce for all weights. A bf16 run
records the same amax at its next forward, so scales, bytes and losses are those of a run without FP8
parameters (the delayed recipe bit for bit; tensorwise as well). One difference: a step skipped for an fp16
overflow casts nothing, so its weight amax is missing from the history (as with Transformer Engine).

Device moves move q; dtype casts of the model (Float16Module's `.to(bfloat16)`) change `weight_dtype` and
the kept initial weight, never q (`apply_keeping_fp8_weight`).
"""

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.fp8.quantize import quantize_rounded

FP8_PARAM_DTYPE = torch.float8_e4m3fn  # weights are E4M3 in both formats (hybrid uses E5M2 for gradients only)


def is_fp8_param(tensor) -> bool:
    """Whether `tensor` is a parameter stored in FP8 (its layer's `Fp8Scaling` is `tensor.fp8_scaling`)."""
    return getattr(tensor, "fp8_scaling", None) is not None


def fp8_param_dtype(param: torch.nn.Parameter) -> torch.dtype:
    """The dtype an FP8 parameter stands for: its gradient's and its checkpoint entry's."""
    return param.fp8_scaling.weight_dtype


@torch.no_grad()
def store_weight_in_fp8(layer: torch.nn.Module) -> None:
    """Makes `layer.weight` (a parallel linear whose GEMM runs in FP8: `layer.fp8` is its Fp8Scaling) an FP8
    parameter: q = cast(W) with the weight's current scale (scale 1 before any step, as a bf16 run's first
    forward uses), W kept as the initial weight. Layout attributes (tensor-parallel split, ...) stay."""
    weight, scaling = layer.weight, layer.fp8
    scaling.weight_dtype = weight.dtype
    scaling.weight_scale_inv = torch.ones((), dtype=torch.float32, device=weight.device)
    scaling.initial_weight = weight.data
    weight.data = torch.empty(weight.shape, dtype=FP8_PARAM_DTYPE, device=weight.device)
    weight.fp8_scaling = scaling
    cast_into_fp8_params([weight], [scaling.initial_weight])


@torch.no_grad()
def cast_into_fp8_params(params: Sequence[torch.nn.Parameter], values: Sequence[Optional[torch.Tensor]],
                         starts: Optional[Sequence[int]] = None, group: Optional[dist.ProcessGroup] = None) -> None:
    """For each FP8 parameter p: elements [start, start + n) of p (flattened) <- cast(values[i]), values[i] n
    elements of any float dtype (None: this rank writes no piece of p). Then each p's inverse scale is that of
    the cast, and with the delayed recipe its amax is recorded.

    The amax of p's new value is the max over the pieces the ranks of `group` write (one all-reduce for all
    params; None: this rank writes all of p), so every rank must pass the same params in the same order."""
    if not params:
        return
    starts = starts if starts is not None else [0] * len(params)
    values = [None if value is None or not value.numel() else value.reshape(-1) for value in values]
    zero = torch.zeros((), dtype=torch.float32, device=params[0].device)
    # max |round(V)| = round(max |V|) (rounding is monotonic): the amaxes without a rounded copy of V.
    amaxes = torch.stack([zero if value is None else
                          torch.linalg.vector_norm(value, float("inf")).to(fp8_param_dtype(param)).float()
                          for param, value in zip(params, values)])  # [P]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    for param, value, start, amax in zip(params, values, starts, amaxes.unbind()):
        scaling = param.fp8_scaling
        scale = scaling.weight_write_scale(amax)
        if value is not None:
            quantized = quantize_rounded(value, scale, FP8_PARAM_DTYPE, scaling.weight_dtype)
            param.detach().view(-1)[start : start + value.numel()].copy_(quantized)
        scaling.weight_written(scale, amax)


def dequantize_fp8_param(param: torch.nn.Parameter) -> torch.Tensor:
    """W = q * weight_scale_inv in the parameter's `fp8_param_dtype` (a new tensor of its shape)."""
    scaling = param.fp8_scaling
    return (param.detach().float() * scaling.weight_scale_inv).to(scaling.weight_dtype)


def high_precision_value(param: torch.nn.Parameter) -> torch.Tensor:
    """An FP8 parameter's value for an optimizer's main param: the initial weight while it is kept (the
    exact value, not its FP8 cast), else the dequantized bytes (as Megatron-LM does after a load)."""
    initial = param.fp8_scaling.initial_weight
    return initial if initial is not None else dequantize_fp8_param(param)


def release_initial_weights(params: Sequence[torch.nn.Parameter]) -> None:
    """Drops the kept initial weights of the FP8 ones among `params` (an optimizer has its main params now)."""
    for param in params:
        if is_fp8_param(param):
            param.fp8_scaling.initial_weight = None


def load_fp8_weight(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """A checkpoint's W (high precision) into an FP8 parameter, cast with the weight's current scale (restore
    the scaling state first); the kept initial weight, if any, is out of date and dropped."""
    cast_into_fp8_params([param], [value])
    release_initial_weights([param])


def fp8_param_tensors(param: torch.nn.Parameter) -> List[torch.Tensor]:
    """What makes up an FP8 parameter on this rank, for a copy from another rank (DDP's `broadcast_params`): its
    bytes (as uint8: collectives need not know float8), inverse scale, scaling state (delayed recipe) and kept
    initial weight."""
    scaling = param.fp8_scaling
    tensors = [param.data.view(torch.uint8), scaling.weight_scale_inv, scaling.meta, scaling.initial_weight]
    return [tensor for tensor in tensors if tensor is not None]


def apply_keeping_fp8_weight(layer: torch.nn.Module, apply, fn, recurse: bool = True) -> torch.nn.Module:
    """`Module._apply` of a layer whose weight may be an FP8 parameter (`apply` is the layer's super()._apply):
    the bytes only follow device moves. A cast such as `.to(torch.bfloat16)` would turn the FP8 values into
    bf16 numbers without their scale; the layer's Fp8Scaling follows the cast instead (scaling.py)."""
    weight = layer._parameters.get("weight")
    if not is_fp8_param(weight):
        return apply(fn, recurse)
    layer._parameters["weight"] = None  # hidden from `fn` in place, so the parameter order stays
    try:
        apply(fn, recurse)
    finally:
        layer._parameters["weight"] = weight
    device = fn(torch.empty(0, device=weight.device)).device
    if device != weight.device:
        weight.data = weight.data.to(device)
    return layer


def fp8_params(params: Sequence[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    """The FP8 parameters among `params`, in order."""
    return [param for param in params if is_fp8_param(param)]
