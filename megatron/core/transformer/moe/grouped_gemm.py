"""One GEMM per expert over variable-size row groups: y_e = x_e W_e^T for consecutive row blocks x_e.

`torch._grouped_mm` does all groups in one kernel on Hopper-class GPUs (bf16, rows and columns in
multiples of 16 bytes); elsewhere (CPU, fp32, older GPUs) a loop of `F.linear` computes the same thing.
"""

import torch
import torch.nn.functional as F


def grouped_mm_supported(rows: torch.Tensor, weights: list) -> bool:
    """True where `torch._grouped_mm` runs: CUDA capability >= 9.0, bf16, 16-byte aligned widths."""
    if not (hasattr(torch, "_grouped_mm") and rows.is_cuda and rows.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(rows.device)[0] < 9:
        return False
    return all(size % 8 == 0 for size in weights[0].shape)


def grouped_linear(rows: torch.Tensor, weights: list, tokens_per_group: torch.Tensor, use_grouped_mm: bool):
    """rows [N, in] split into consecutive blocks of `tokens_per_group` [G] rows; weights G x [out, in]
    -> [N, out]."""
    if use_grouped_mm and grouped_mm_supported(rows, weights):
        stacked = torch.stack(weights).transpose(1, 2)  # [G, in, out]
        offsets = torch.cumsum(tokens_per_group, dim=0).to(device=rows.device, dtype=torch.int32)
        return torch._grouped_mm(rows, stacked, offs=offsets)
    blocks = torch.split(rows, tokens_per_group.tolist(), dim=0)
    return torch.cat([F.linear(block, weight) for block, weight in zip(blocks, weights)], dim=0)
