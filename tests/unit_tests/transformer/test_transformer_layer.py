"""TransformerLayer wiring: pre-norm residuals, the post-norm residual option and global layer numbers."""

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@pytest.mark.parametrize("post_norm_residual", [False, True])
def test_residual_wiring(post_norm_residual):
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0,
        apply_residual_connection_post_layernorm=post_norm_residual,
    )
    torch.manual_seed(0)
    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=2).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.3)
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        output, context = layer(x, attention_mask=None)
        # x1 = r1 + attn(n1) + b_proj, x2 = r2 + mlp(n2) + b_fc2, with r = n (post-norm) or the input.
        n1 = layer.input_layernorm(x)
        attention, proj_bias = layer.self_attention(n1, attention_mask=None)
        x1 = (n1 if post_norm_residual else x) + attention + proj_bias
        n2 = layer.pre_mlp_layernorm(x1)
        mlp, fc2_bias = layer.mlp(n2)
        expected = (n2 if post_norm_residual else x1) + mlp + fc2_bias
    assert context is None and layer.layer_number == 2
    torch.testing.assert_close(output, expected)
