"""The only module that imports NVIDIA apex. Optional: without it the norms are torch's own kernels.

Norms. `apex.normalization.fused_layer_norm` has the functions behind apex's FusedLayerNorm / FusedRMSNorm
modules; they are called with our norms' own parameters (state-dict keys, zero-centred gamma and the
sequence-parallel marking stay in torch_norm.py) and compute, over the last dimension of size h,

    fused_layer_norm_affine(x, w, b, (h,), eps) = (x - mean) / sqrt(var + eps) * w + b
    fused_rms_norm_affine(x, w, (h,), eps)      = x / sqrt(mean(x^2) + eps) * w

with fp32 statistics, as torch.nn.functional.layer_norm / rms_norm do (the two differ by rounding only).
They take a call when apex and its CUDA extension `fused_layer_norm_cuda` import, x is on CUDA, w has x's
dtype (apex's non-"mixed" kernels read w as x's type) and torch.compile is not tracing (Inductor fuses
torch's norm with its neighbours; apex's own modules step aside there too). Everything else runs torch's
norm, compiled on CUDA (fusions/cuda_fuser.py) as a compiled model runs it: torch's eager layer norm took 35 us
forward and 35 + 47 us backward (two kernels) at [8192, 2048] bf16 on an H200, about 2.5x the time its bytes
take to move.

Adam. apex.optimizers.FusedAdam is never used, installed or not, although Megatron-LM takes it when present:
- with --bf16/--fp16 on CUDA the step is fusions/fused_adamw.py: the AdamW update and the copy into the
  bf16/fp16 model params in one Triton pass over memory; FusedAdam does the update alone and leaves the
  copy to a second pass;
- with fp32 params torch.optim.AdamW(fused=True) is the same design as FusedAdam (one multi-tensor kernel);
- FusedAdam keeps the step count per param group (`group["step"]`), torch's AdamW per parameter
  (`state[p]["step"]`), so the optimizer state and its checkpoints would depend on whether apex is there.
Both compute the same AdamW (FusedAdam with adam_w_mode=True: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)),
so leaving it out changes no result.
"""

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megatron.core.extensions import import_optional
from megatron.core.fusions.cuda_fuser import cuda_fuser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedNorms:
    """apex's fused norm functions (`rms_norm_affine` is None in apex builds older than its RMS norm)."""

    layer_norm_affine: Callable
    rms_norm_affine: Callable | None

    def layer_norm(self, x, weight, bias, eps: float) -> torch.Tensor:
        return self.layer_norm_affine(x, weight, bias, weight.shape, eps)

    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        return self.rms_norm_affine(x, weight, weight.shape, eps)


@functools.cache
def load_fused_norms() -> FusedNorms | None:
    """apex's fused norms when apex and its CUDA extension import, else None (a broken install says why)."""
    functions = import_optional("apex.normalization.fused_layer_norm", instead="the norms are torch's")
    if functions is None:
        return None
    if import_optional("fused_layer_norm_cuda", instead="the norms are torch's") is None:
        logger.warning("apex is installed without its CUDA extension fused_layer_norm_cuda; the norms are torch's "
                       "(build apex with --cuda_ext for its fused norms)")
        return None
    return FusedNorms(functions.fused_layer_norm_affine, getattr(functions, "fused_rms_norm_affine", None))


def fused_norms_for(x: torch.Tensor, weight: torch.Tensor) -> FusedNorms | None:
    """apex's norms when they can take x with this weight (CUDA, one dtype, not compiling), else None."""
    if not x.is_cuda or weight.dtype != x.dtype or torch.compiler.is_compiling():
        return None
    return load_fused_norms()


@cuda_fuser
def _torch_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


@cuda_fuser
def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer norm over the last dimension: apex's fused kernel where it applies, else torch's (compiled on
    CUDA)."""
    fused = fused_norms_for(x, weight)
    if fused is not None:
        return fused.layer_norm(x, weight, bias, eps)
    return _torch_layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension: apex's fused kernel where it applies, else torch's (compiled on
    CUDA)."""
    fused = fused_norms_for(x, weight)
    if fused is not None and fused.rms_norm_affine is not None:
        return fused.rms_norm(x, weight, eps)
    return _torch_rms_norm(x, weight, eps)


def describe_norms() -> str:
    """One line for the banner and `doctor`: which kernels the layer and RMS norms use."""
    fused = load_fused_norms()
    if fused is None:
        return "torch layer_norm / rms_norm, compiled on CUDA (apex's fused norms not installed)"
    kinds = "layer norm" if fused.rms_norm_affine is None else "layer and RMS norm"
    return f"apex fused {kinds} on CUDA (input and weight of one dtype), torch's (compiled on CUDA) for the rest"
