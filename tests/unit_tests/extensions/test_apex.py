"""apex's fused norms in LayerNorm / RMSNorm, against torch's norms, with a stand-in `apex` package.

apex is not installed here (nor on the GPU machines). The stand-in's functions compute what apex documents
for `fused_layer_norm_affine(input, weight, bias, normalized_shape, eps)` and
`fused_rms_norm_affine(input, weight, normalized_shape, eps)` (fp32 statistics, output in the input's
dtype), so these tests check what this framework owns: the arguments and which calls go to apex.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions.apex import describe_norms, fused_norms_for, layer_norm, load_fused_norms, rms_norm
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from .gradients import output_and_grads

H = 16


def _install_stand_in_apex(monkeypatch, calls: list, with_rms_norm: bool = True, with_cuda_extension: bool = True):
    def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
        calls.append("layer_norm")
        dims = tuple(range(-len(normalized_shape), 0))
        x = input.float()
        normed = (x - x.mean(dims, keepdim=True)) / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
        return (normed * weight.float() + bias.float()).to(input.dtype)

    def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
        calls.append("rms_norm")
        dims = tuple(range(-len(normalized_shape), 0))
        x = input.float()
        return (x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps) * weight.float()).to(input.dtype)

    functions = types.ModuleType("apex.normalization.fused_layer_norm")
    functions.fused_layer_norm_affine = fused_layer_norm_affine
    if with_rms_norm:
        functions.fused_rms_norm_affine = fused_rms_norm_affine
    for name, module in (("apex", types.ModuleType("apex")),
                         ("apex.normalization", types.ModuleType("apex.normalization")),
                         ("apex.normalization.fused_layer_norm", functions),
                         ("fused_layer_norm_cuda", types.ModuleType("fused_layer_norm_cuda") if with_cuda_extension
                          else None)):
        monkeypatch.setitem(sys.modules, name, module)
    load_fused_norms.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_loader():
    load_fused_norms.cache_clear()
    yield
    load_fused_norms.cache_clear()


def _leaf(*shape, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 2 + 0.5).to(device, dtype).requires_grad_()


def test_adapter_passes_apex_its_documented_arguments(monkeypatch):
    calls = []
    _install_stand_in_apex(monkeypatch, calls)
    fused = load_fused_norms()
    x, weight, bias = _leaf(3, 2, H), _leaf(H, seed=1), _leaf(H, seed=2)
    ours = output_and_grads(lambda x, w, b: fused.layer_norm(x, w, b, 1e-5), (x, weight, bias))
    torch_ = output_and_grads(lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5), (x, weight, bias))
    for got, want in zip(ours, torch_):
        torch.testing.assert_close(got, want)
    ours = output_and_grads(lambda x, w: fused.rms_norm(x, w, 1e-6), (x, weight))
    torch_ = output_and_grads(lambda x, w: F.rms_norm(x, (H,), w, 1e-6), (x, weight))
    for got, want in zip(ours, torch_):
        torch.testing.assert_close(got, want)
    assert calls == ["layer_norm", "rms_norm"]


def test_on_a_cpu_the_norms_are_torch_s_even_with_apex_installed(monkeypatch):
    calls = []
    _install_stand_in_apex(monkeypatch, calls)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2)
    x = _leaf(3, 2, H)
    norm = WrappedTorchNorm(config, H)
    assert fused_norms_for(x, norm.weight) is None
    torch.testing.assert_close(norm(x), F.layer_norm(x, (H,), norm.weight, norm.bias, 1e-5))
    assert calls == []


def test_loader_needs_apex_and_its_cuda_extension(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "apex", None)
    monkeypatch.setitem(sys.modules, "apex.normalization", None)
    monkeypatch.setitem(sys.modules, "apex.normalization.fused_layer_norm", None)
    assert load_fused_norms() is None
    assert describe_norms() == "torch layer_norm / rms_norm, compiled on CUDA (apex's fused norms not installed)"
    _install_stand_in_apex(monkeypatch, [], with_cuda_extension=False)
    assert load_fused_norms() is None and "without its CUDA extension fused_layer_norm_cuda" in caplog.text
    _install_stand_in_apex(monkeypatch, [], with_rms_norm=False)
    assert load_fused_norms().rms_norm_affine is None
    assert describe_norms().startswith("apex fused layer norm on CUDA")
    _install_stand_in_apex(monkeypatch, [])
    assert describe_norms().startswith("apex fused layer and RMS norm on CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apex_takes_the_norms_on_gpu(monkeypatch, normalization):
    calls = []
    _install_stand_in_apex(monkeypatch, calls)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, normalization=normalization,
                               layernorm_zero_centered_gamma=True, params_dtype=torch.bfloat16, bf16=True)
    norm = WrappedTorchNorm(config, H).cuda()
    with torch.no_grad():
        for param in norm.parameters():
            param.uniform_(-0.5, 0.5)
    x = _leaf(3, 2, H, dtype=torch.bfloat16, device="cuda")
    ours = output_and_grads(norm, [x])
    weight, bias = norm.weight + 1, getattr(norm, "bias", None)
    expected = F.layer_norm(x, (H,), weight, bias, 1e-5) if normalization == "LayerNorm" else F.rms_norm(
        x, (H,), weight, 1e-5)
    assert calls == [{"LayerNorm": "layer_norm", "RMSNorm": "rms_norm"}[normalization]]
    torch.testing.assert_close(ours[0], expected.detach(), atol=1e-2, rtol=1.6e-2)
    assert fused_norms_for(x.float(), norm.weight) is None  # fp32 input, bf16 weight: torch's kernel




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 3, 64), (256, 4, 2048)])
def test_torch_norms_compiled_on_cuda_equal_eager_torch(dtype, shape):
    """Without apex, layer_norm and rms_norm run torch's norm compiled on CUDA: its output and the gradients of
    input, weight and bias equal eager torch's on the same inputs, to rounding (bf16: 1e-2 of the largest value,
    fp32: 1e-4: the weight and bias gradients sum 1024 rows in another order)."""
    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=generator)
    weight, bias = (1 + 0.1 * torch.randn(shape[-1], device="cuda", dtype=dtype, generator=generator) for _ in range(2))
    cases = ((lambda x, w, b: layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, w.shape, w, b, 1e-5),
              (x, weight, bias)),
             (lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, w.shape, w, 1e-5), (x, weight)))
    for ours, eager, inputs in cases:
        got = output_and_grads(ours, [t.clone().requires_grad_() for t in inputs])
        expected = output_and_grads(eager, [t.clone().requires_grad_() for t in inputs])
        for mine, theirs in zip(got, expected):
            tolerance = (1e-2 if dtype == torch.bfloat16 else 1e-4) * theirs.abs().max().item()
            torch.testing.assert_close(mine, theirs, atol=tolerance, rtol=0)
