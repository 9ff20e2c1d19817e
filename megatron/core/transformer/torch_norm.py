"""LayerNorm and RMSNorm in plain PyTorch, with Megatron's zero-centred-gamma option.

With `zero_centered_gamma` (`--apply-layernorm-1p`) the stored weight is w - 1 (initialised to 0) and
the forward uses w = weight + 1, so weight decay pulls the scale towards 1 instead of 0.
The kernels are torch's, or apex's fused ones on CUDA when apex is installed (extensions/apex.py).
`forward_with_residual` serves a norm whose input is also the residual stream: (norm(x), x), the two gradients
of x summed in the norm's backward (fusions/fused_norm_residual.py).
Parameters carry `sequence_parallel`, telling the grad sync to all-reduce them over TP when the
activations they see are sequence-split.
"""

import torch

from megatron.core.extensions.apex import layer_norm, rms_norm
from megatron.core.fusions.fused_norm_residual import norm_and_residual
from megatron.core.tensor_parallel.layers import parameter_device
from megatron.core.transformer.transformer_config import TransformerConfig


def _norm_parameter(config: TransformerConfig, hidden_size: int, value: float) -> torch.nn.Parameter:
    param = torch.nn.Parameter(
        torch.full((hidden_size,), value, dtype=config.params_dtype, device=parameter_device(config))
    )
    param.sequence_parallel = config.sequence_parallel
    return param


class _ScaledNorm(torch.nn.Module):
    """The learned per-channel scale w shared by both norms (stored as w - 1 when zero-centred)."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool = False
    ):
        super().__init__()
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        self.weight = _norm_parameter(config, hidden_size, 0.0 if zero_centered_gamma else 1.0)

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class LayerNorm(_ScaledNorm):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last dimension."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool = False
    ):
        super().__init__(config, hidden_size, eps, zero_centered_gamma)
        self.bias = _norm_parameter(config, hidden_size, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.scale(), self.bias, self.eps)

    def forward_with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), x) for a norm whose input is also the residual stream: the residual's gradient is added in
        the norm's backward (fusions/fused_norm_residual.py)."""
        return norm_and_residual(x, self.scale(), self.bias, self.eps)


class RMSNorm(_ScaledNorm):
    """y = x / sqrt(mean(x^2) + eps) * w over the last dimension (no bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)

    def forward_with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), x), the residual's gradient added in the norm's backward (LayerNorm.forward_with_residual)."""
        return norm_and_residual(x, self.scale(), None, self.eps)


class WrappedTorchNorm:
    """Spec slot for a norm: builds `LayerNorm` or `RMSNorm` according to `config.normalization`
    (or `normalization` when given), zero-centred when `config.layernorm_zero_centered_gamma`."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ):
        normalization = normalization or config.normalization
        norms = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
        if normalization not in norms:
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        zero_centered = zero_centered_gamma or config.layernorm_zero_centered_gamma
        return norms[normalization](config, hidden_size, eps=eps, zero_centered_gamma=zero_centered)
