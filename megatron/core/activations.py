"""MLP activation functions beyond `torch.nn.functional` (Megatron-LM's `--openai-gelu`,
`--squared-relu`, `--quick-geglu`)."""

import torch
import torch.nn.functional as F


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (HF `gelu_new`)."""
    return F.gelu(x, approximate="tanh")


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer, So et al. 2021)."""
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), the sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)
