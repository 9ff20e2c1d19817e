"""LayerNorm / RMSNorm against their formulas, and the zero-centred (layernorm-1p) weights."""

import torch

from megatron.core.transformer.torch_norm import LayerNorm, RMSNorm, WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

H = 16


def _config(**kwargs):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, **kwargs)


def _x():
    return torch.randn(3, 2, H, generator=torch.Generator().manual_seed(0)) * 2 + 1


def test_layer_norm_formula_and_zero_centred_gamma():
    x = _x()
    norm = WrappedTorchNorm(_config(layernorm_epsilon=1e-6), H, eps=1e-6)
    assert isinstance(norm, LayerNorm)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    expected = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), expected * norm.weight + norm.bias)

    centred = WrappedTorchNorm(_config(layernorm_zero_centered_gamma=True), H, eps=1e-6)
    assert torch.equal(centred.weight.data, torch.zeros(H))  # stored as w - 1
    with torch.no_grad():
        centred.weight.copy_(norm.weight - 1)
        centred.bias.copy_(norm.bias)
    torch.testing.assert_close(centred(x), norm(x))


def test_rms_norm_formula_and_sequence_parallel_marking():
    x = _x()
    norm = WrappedTorchNorm(_config(normalization="RMSNorm"), H, eps=1e-5)
    assert isinstance(norm, RMSNorm) and [name for name, _ in norm.named_parameters()] == ["weight"]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert norm.weight.sequence_parallel is False
    explicit = WrappedTorchNorm(_config(), H, normalization="RMSNorm")  # the spec may fix the type
    assert isinstance(explicit, RMSNorm)


def test_params_dtype_is_honoured():
    norm = WrappedTorchNorm(_config(params_dtype=torch.bfloat16), H)
    assert norm.weight.dtype == norm.bias.dtype == torch.bfloat16
