"""A norm whose input is also the residual stream: `(norm(x), x)`, with the two gradients that reach x summed
inside the norm's backward.

    x ──> norm ──> attention / MLP ──> bias-dropout-add ──> next x
    └──────────────── residual ────────────┘

x feeds both the norm and the residual addition, so autograd receives two gradients for it and adds them in a
kernel of its own: a read of both and a write for every norm of the model (25 additions, 0.31 ms of GPT-2
small's step on an H100; 1.8 ms of GPT 1.3B's). Here the norm's backward, compiled, takes the residual's
gradient into the row pass that computes its own, over the last dimension of size h with x̂ the normalised x
and g = dy * w (all in fp32):

    layer norm  dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)) + d_residual     dw = Σ_rows dy * x̂,  db = Σ_rows dy
    RMS norm    dx = rstd * (g - x̂ * mean(g * x̂)) + d_residual               dw = Σ_rows dy * x̂

(torch's own backward, as its autograd formula for `native_layer_norm`, with the addition folded in.) The
statistics are recomputed from x in that pass instead of saved. The forward is the plain norm's
(extensions/apex.py: torch's, compiled on CUDA); on CPU both directions run eagerly. Where apex's kernel runs
the norm, it keeps its own backward and autograd adds the two gradients.
"""

import torch

from megatron.core.extensions.apex import fused_norms_for, layer_norm, rms_norm
from megatron.core.fusions.cuda_fuser import cuda_fuser


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps) if bias is None else layer_norm(x, weight, bias, eps)


@cuda_fuser
def _backward(x: torch.Tensor, weight: torch.Tensor, grad_normed: torch.Tensor, grad_residual: torch.Tensor,
              eps: float, layer_norm: bool):
    """(dx, dw, db or None): the formulas of the module docstring; dw and db summed over every row."""
    x32, dy = x.float(), grad_normed.float()
    if layer_norm:
        x32 = x32 - x32.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)
    normalised = x32 * rstd
    g = dy * weight.float()
    dx = g - normalised * (g * normalised).mean(dim=-1, keepdim=True)
    if layer_norm:
        dx = dx - g.mean(dim=-1, keepdim=True)
    dx = rstd * dx + grad_residual.float()
    rows = tuple(range(x.dim() - 1))
    dw = (dy * normalised).sum(dim=rows).to(weight.dtype)
    db = dy.sum(dim=rows).to(weight.dtype) if layer_norm else None
    return dx.to(x.dtype), dw, db


class _NormAndResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.layer_norm = eps, bias is not None
        return _norm(x, weight, bias, eps), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_normed, grad_residual):
        x, weight = ctx.saved_tensors
        dx, dw, db = _backward(x, weight, grad_normed, grad_residual, ctx.eps, ctx.layer_norm)
        return dx, dw, db, None


def norm_and_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """(layer norm of x over the last dimension, or RMS norm where `bias` is None; x as the residual stream)
    (module docstring)."""
    fused = fused_norms_for(x, weight)
    if fused is not None and (bias is not None or fused.rms_norm_affine is not None):
        return _norm(x, weight, bias, eps), x
    return _NormAndResidual.apply(x, weight, bias, eps)
