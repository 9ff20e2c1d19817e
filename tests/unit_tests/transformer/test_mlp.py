"""MLP activations against the formulas written out: plain, gated (fc1 = [gate; up]), fused-bias GELU."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

H, FFN = 8, 12


def _tanh_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _mlp_and_reference(**config):
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, **config)
    torch.manual_seed(0)
    mlp = build_module(get_gpt_layer_local_spec().submodules.mlp, config=config)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_()
    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    b1 = mlp.linear_fc1.bias if mlp.linear_fc1.bias is not None else 0
    return mlp, (lambda x: x @ w1.t() + b1), w2, mlp.linear_fc2.bias


@pytest.mark.parametrize(
    "config, activation",
    [
        (dict(), lambda h: F.gelu(h)),  # exact erf GELU
        (dict(bias_activation_fusion=True), _tanh_gelu),  # Megatron's fused bias-GELU
        (dict(activation_func=squared_relu), lambda h: F.relu(h) ** 2),
        (dict(gated_linear_unit=True, activation_func=F.silu), lambda h: F.silu(h[..., :FFN]) * h[..., FFN:]),
        (dict(gated_linear_unit=True, bias_activation_fusion=True), lambda h: _tanh_gelu(h[..., :FFN]) * h[..., FFN:]),
    ],
)
def test_mlp_formula(config, activation):
    mlp, fc1, w2, b2 = _mlp_and_reference(**config)
    x = torch.randn(3, 2, H)
    output, bias = mlp(x)
    assert bias is b2  # returned for the bias-dropout-add, not added here
    torch.testing.assert_close(output, activation(fc1(x)) @ w2.t())
