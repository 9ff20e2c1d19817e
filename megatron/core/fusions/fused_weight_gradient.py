"""Linear layer whose weight gradient is accumulated straight into DDP's `main_grad` buffer.

    Y = X W^T + b                    X [..., in], W [out, in]
    dX = dY W,   main_grad += dY^T X (fp32 accumulation in the GEMM itself),   db = sum over tokens of dY

Without it autograd writes dW in bf16 and DDP's hook adds it into the fp32 `main_grad` (one more pass
over every weight: a read of dW and a read-modify-write of main_grad). Megatron-LM does the same with
apex's `fused_weight_gradient_mlp_cuda` (`--gradient-accumulation-fusion`); here cuBLAS's bf16 x bf16 ->
fp32 GEMM with beta = 1 (`torch.addmm(..., out_dtype=float32, out=main_grad)`) does it without apex.

The backward hands autograd an uninitialised dummy for dW and sets `weight.grad_added_to_main_grad`,
which tells DDP's hook not to add it (the same protocol as Megatron-LM). The bias goes the same way:
b.main_grad += 1^T dY, a GEMV with fp32 output (`add_bias_gradient`). Autograd's bf16 column sum of dY
read it at ~430 GB/s on an H100 for GPT-2 small's [8192, 2304] (29 us, 1.9 TB/s for GPT 1.3B's
[8192, 6144]: 1.3 ms a step), and DDP's hook then copied the bf16 result into main_grad (one more launch
per bias).

With bf16 (or fp16) gradient buffers (`--main-grads-dtype bf16`, `--grad-reduce-in-bf16`) the same GEMMs write
and accumulate into a main_grad of the weight's own dtype (fp32 arithmetic, one rounding per GEMM), as
Megatron-LM's `wgrad_gemm_accum_fp16` does; autograd would instead round dW to bf16, and DDP's hook then copy
or add it (a second rounding) into the buffer.

DDP does not zero its gradient buffer at the start of a step: it marks each param `overwrite_main_grad`
(Megatron-FSDP's name for it) instead, meaning "main_grad holds nothing of this step yet". The first writer
then writes (the GEMM with beta = 0, which does not read what main_grad held; DDP's hook copies) and clears
the mark; later writers accumulate. That saves a pass over the whole fp32 buffer per step (or per
microbatch, for the transient gradient storage of the sharded strategies).
"""

import torch
import torch.nn.functional as F


def takes_main_grad(param: torch.Tensor) -> bool:
    """Whether `param.main_grad` holds nothing of this step yet (module docstring), in which case the caller
    writes it instead of adding to it; the mark is cleared either way."""
    empty = getattr(param, "overwrite_main_grad", False)
    if empty:
        param.overwrite_main_grad = False
    return empty


def _addmm_into(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    """main_grad = a @ b + beta * main_grad, computed in fp32 and rounded once to main_grad's dtype (fp32, or
    the operands' own bf16/fp16)."""
    if main_grad.dtype == a.dtype:
        torch.addmm(main_grad, a, b, beta=beta, out=main_grad)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, a, b, beta=beta, out_dtype=main_grad.dtype, out=main_grad)
    else:  # CPU has no mixed-dtype GEMM; the same sum in fp32
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype), beta=beta)


def add_weight_gradient(weight: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """weight.main_grad [out, in] += grad_output[n, out]^T @ input[n, in], accumulated by the GEMM into
    main_grad's dtype, or written when main_grad holds nothing of this step yet; marks the weight
    `grad_added_to_main_grad`."""
    beta = 0.0 if takes_main_grad(weight) else 1.0  # beta 0: main_grad's old bytes (maybe NaN) are not read
    _addmm_into(weight.main_grad, grad_output.t(), input, beta)
    weight.grad_added_to_main_grad = True


def add_bias_gradient(bias: torch.Tensor, grad_output: torch.Tensor, accumulate: bool = True) -> torch.Tensor:
    """bias.main_grad [out] += the column sums of grad_output [n, out] (written when main_grad holds nothing of
    this step yet), marking the bias `grad_added_to_main_grad`; returns the never-read placeholder gradient to
    hand autograd. Without `accumulate` (no gradient-accumulation fusion), or where the bias has no main_grad
    to take it: the column sums, for autograd."""
    if not accumulate or not can_accumulate_in_main_grad(bias):
        return grad_output.sum(dim=0)
    beta = 0.0 if takes_main_grad(bias) else 1.0
    _addmm_into(bias.main_grad.view(1, -1), grad_output.new_ones(1, grad_output.size(0)), grad_output, beta)
    bias.grad_added_to_main_grad = True
    return torch.empty_like(bias)


class _LinearWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input)
        # The parameter itself, not a saved copy: activation recomputation (torch.utils.checkpoint) hands
        # back recomputed saved tensors, which lack main_grad.
        ctx.weight, ctx.bias = weight, bias
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (input,), weight = ctx.saved_tensors, ctx.weight
        grad_input = grad_output.matmul(weight)  # [..., out] @ [out, in]
        grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))  # [n, out]
        add_weight_gradient(weight, grad_output_2d, input.reshape(-1, input.size(-1)))
        dummy_weight_grad = torch.empty_like(weight)  # never read: DDP's hook sees grad_added_to_main_grad
        grad_bias = add_bias_gradient(ctx.bias, grad_output_2d) if ctx.bias is not None else None
        return grad_input, dummy_weight_grad, grad_bias


def can_accumulate_in_main_grad(weight: torch.Tensor) -> bool:
    """True where the fused path applies: a bf16/fp16 weight with DDP's `main_grad` in fp32 or in the weight's
    own dtype, outside a `torch.compile` region (a compiled layer keeps autograd's own weight gradient)."""
    main_grad = getattr(weight, "main_grad", None)
    return (
        main_grad is not None
        and main_grad.dtype in (torch.float32, weight.dtype)
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.requires_grad
        and not torch.compiler.is_compiling()
    )


def linear_with_grad_accumulation(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """`F.linear(input, weight, bias)` whose weight gradient goes into `weight.main_grad` (see above);
    plain `F.linear` where `can_accumulate_in_main_grad(weight)` is False."""
    if not can_accumulate_in_main_grad(weight):
        return F.linear(input, weight, bias)
    return _LinearWithGradAccumulation.apply(input, weight, bias)
