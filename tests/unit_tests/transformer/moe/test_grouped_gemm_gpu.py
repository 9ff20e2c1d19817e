"""On a Hopper-class GPU, `torch._grouped_mm` experts compute what the per-expert loop computes (bf16)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.grouped_gemm import grouped_mm_supported
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_grouped_mm_equals_the_loop_forward_and_backward():
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=2, num_moe_experts=4,
                               moe_ffn_hidden_size=256, add_bias_linear=False, gated_linear_unit=True,
                               activation_func=F.silu, params_dtype=torch.bfloat16, moe_grouped_gemm=True)
    torch.manual_seed(0)
    experts = GroupedMLP(4, config, [0, 1, 2, 3]).cuda()
    rows = torch.randn(100, 128, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_supported(rows, experts.linear_fc1.weights()):
        pytest.skip("torch._grouped_mm needs compute capability >= 9.0")
    counts = torch.tensor([40, 0, 35, 25])  # an expert without tokens included
    results = []
    for grouped in (True, False):
        experts.use_grouped_mm = grouped
        experts.zero_grad()
        x = rows.clone().requires_grad_(True)
        output = experts(x, counts)
        output.float().square().sum().backward()
        results.append((output.float(), x.grad.float(), experts.linear_fc1.weight2.grad.float()))
    for grouped_value, loop_value in zip(*results):
        torch.testing.assert_close(grouped_value, loop_value, rtol=2e-2, atol=2e-2)
