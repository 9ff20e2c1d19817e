"""The FP8 linear layer: Y = X W^T (+ b) with X, W and dY quantized per tensor, three `torch._scaled_mm` GEMMs.

    X [M, K] (M tokens), W [N, K], Y [M, N]; q_T = quantize(T) (scaling.py), s_T its inverse scale
    forward   Y  = (q_X s_X) (q_W s_W)^T (+ b)      q_X, q_W in E4M3; bf16 output, bias in the GEMM
    backward  dX = (q_dY s_dY) (q_W s_W)             q_dY in E4M3 (fp8="e4m3") or E5M2 ("hybrid")
              dW = (q_dY s_dY)^T (q_X s_X)           fp32 output; bf16 dY^T X with wgrad=False
              db = sum over tokens of dY

Layouts (`torch._scaled_mm(a, b)` wants `a` row-major, `b` column-major, sizes multiples of 16): the forward
takes q_X [M, K] and q_W^T (q_W [N, K] as it is); dX takes q_dY [M, N] and q_W^T [K, N] contiguous, which
the scaling state writes together with q_W once per step (scaling.py: `quantize_weight`); dW takes
q_dY^T [N, M'] and q_X^T [K, M'] (M' = M rounded up to 16 with zero tokens), written by the same kernels
that quantize X and dY. Saved for backward: q_X^T (one byte per element instead of bf16's two), or X
itself with wgrad=False. The forward GEMM accumulates with cuBLAS' fast mode and the two backward GEMMs
without it, as Transformer Engine and torchao do.

With gradient-accumulation fusion dW goes into the weight's fp32 or bf16 `main_grad` (db into the bias's) and the
weight is marked `grad_added_to_main_grad` (the protocol of fusions/fused_weight_gradient.py). The first dW of
a step (DDP marked `main_grad` as holding nothing yet, or zeroed it and nothing has written it since) is
written straight into `main_grad` by the GEMM; later microbatches add theirs. A weight stored in FP8
(params.py) takes this path always, into a `main_grad` of fp32 or bf16 (`--grad-reduce-in-bf16`): autograd
would cast its dW to FP8.

On CUDA the GEMMs need compute capability 8.9 (Ada, Hopper) or newer; on CPU `torch._scaled_mm` computes
the same products exactly (slowly), which is what the CPU tests run.
"""

import functools

import torch

from megatron.core.fp8.params import is_fp8_param
from megatron.core.fp8.scaling import GRAD_OUTPUT, INPUT, Fp8Scaling
from megatron.core.fusions.fused_weight_gradient import (
    add_bias_gradient,
    add_weight_gradient,
    can_accumulate_in_main_grad,
    takes_main_grad,
)


@functools.cache
def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise RuntimeError(
            f"FP8 GEMMs (torch._scaled_mm) need a GPU of compute capability 8.9 or newer (Ada, Hopper, "
            f"Blackwell); {torch.cuda.get_device_name(device)} has {major}.{minor}: run without --fp8-format (an FP8 "
            "checkpoint loads into a bf16 model)"
        )


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accumulation=False, bias=None, out=None):
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accumulation, out=out)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, scaling: Fp8Scaling, accumulate: bool, input_gradient: bool,
                weight_gradient: bool):
        in_features, out_features = weight.shape[1], weight.shape[0]
        x = input.reshape(-1, in_features).contiguous()  # [M, K]
        record, fp8_wgrad = scaling.training, scaling.recipe.wgrad and weight_gradient
        q_x = scaling.quantize(x, INPUT, record, transpose=fp8_wgrad)
        q_w = scaling.quantize_weight(weight, record, transpose=input_gradient)
        # _scaled_mm adds a bias only to a bf16/fp16 output of the bias' dtype.
        fused_bias = bias if bias is not None and bias.dtype == input.dtype != torch.float32 else None
        output = _scaled_mm(q_x.data, q_w.data.t(), q_x.scale_inv, q_w.scale_inv, input.dtype, True, fused_bias)
        if bias is not None and fused_bias is None:
            output = output + bias
        # dW's operand: q_X^T [K, M'] for an FP8 dW, else X [M, K] (none for a frozen weight).
        ctx.save_for_backward(q_x.transposed if fp8_wgrad else x if weight_gradient else None)
        # Not saved tensors: the parameter itself (for main_grad; recomputation hands back copies of saved
        # tensors), this step's q_W^T, and the inverse scales (on a GPU the input's is the scaling state's
        # buffer, which later quantizations of the step rewrite in place with the same value: scales change
        # only at the step-end update, after every backward of the step).
        ctx.weight, ctx.weight_transposed, ctx.weight_scale_inv = weight, q_w.transposed, q_w.scale_inv
        ctx.input_scale_inv = q_x.scale_inv
        ctx.scaling, ctx.record, ctx.accumulate, ctx.fp8_wgrad = scaling, record, accumulate, fp8_wgrad
        ctx.bias, ctx.input_shape = bias, input.shape
        return output.view(*input.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_output):
        wgrad_operand, = ctx.saved_tensors
        weight, scaling = ctx.weight, ctx.scaling
        dy = grad_output.reshape(-1, weight.shape[0]).contiguous()  # [M, N]
        q_dy = scaling.quantize(dy, GRAD_OUTPUT, ctx.record, transpose=ctx.fp8_wgrad)
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = _scaled_mm(q_dy.data, ctx.weight_transposed.t(), q_dy.scale_inv, ctx.weight_scale_inv,
                                    grad_output.dtype)
            grad_input = grad_input.view(ctx.input_shape)
        grad_weight = _weight_gradient(ctx, dy, q_dy, wgrad_operand, ctx.input_scale_inv, weight)
        grad_bias = None
        if ctx.bias is not None and ctx.needs_input_grad[2]:
            grad_bias = add_bias_gradient(ctx.bias, dy, ctx.accumulate)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _weight_gradient(ctx, dy, q_dy, wgrad_operand, x_scale_inv, weight):
    """dW [N, K]: returned, or (ctx.accumulate) put into `weight.main_grad` with a dummy returned."""
    if not ctx.needs_input_grad[1]:
        return None
    if not ctx.fp8_wgrad:  # wgrad_operand is X [M, K]
        if not ctx.accumulate:
            return dy.t().matmul(wgrad_operand)
        add_weight_gradient(weight, dy, wgrad_operand)
    else:
        a, b = q_dy.transposed, wgrad_operand.t()  # [N, M'] row-major, [M', K] column-major
        if not ctx.accumulate:
            return _scaled_mm(a, b, q_dy.scale_inv, x_scale_inv, weight.dtype)
        main_grad = weight.main_grad
        if takes_main_grad(weight) or not weight.grad_added_to_main_grad:
            _scaled_mm(a, b, q_dy.scale_inv, x_scale_inv, main_grad.dtype, out=main_grad)
        else:
            main_grad.add_(_scaled_mm(a, b, q_dy.scale_inv, x_scale_inv, main_grad.dtype))
        weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)  # never read: DDP's hook sees grad_added_to_main_grad


@torch.compiler.disable  # a compiled transformer layer runs this GEMM eagerly (its quantizations compile alone)
def fp8_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: Fp8Scaling,
               gradient_accumulation_fusion: bool = False) -> torch.Tensor:
    """`F.linear(input, weight, bias)` with FP8 GEMMs (module docstring): input [..., K] -> [..., N].
    With `gradient_accumulation_fusion` the weight gradient goes into `weight.main_grad` where DDP set one up
    (for a weight stored in FP8, always)."""
    _check_device(input.device)
    # Inside the autograd function the grad mode is off and needs_input_grad ignores it: decided here.
    input_gradient = torch.is_grad_enabled() and input.requires_grad
    weight_gradient = torch.is_grad_enabled() and weight.requires_grad
    if is_fp8_param(weight):
        if weight_gradient and getattr(weight, "main_grad", None) is None:
            raise ValueError(
                "a weight stored in FP8 (TransformerConfig.fp8_param, --fp8-param-gather) gets its gradient in the "
                "main_grad buffer of DistributedDataParallel: wrap the model in it to train"
            )
        accumulate = True
    else:
        accumulate = gradient_accumulation_fusion and can_accumulate_in_main_grad(weight)
    return _Fp8Linear.apply(input, weight, bias, scaling, accumulate, input_gradient, weight_gradient)
