"""fused_apply_rotary_pos_emb against the rotation written out by hand: pairs (x_i, x_{i+d/2}) (or
(x_{2i}, x_{2i+1}) interleaved) rotated by position * base^(-2i/d), partial rotary dims passed through.
CPU runs the eager function; the GPU test runs the compiled kernel (bf16 tolerance, forward and backward)."""

import pytest
import torch

from megatron.core.fusions.fused_rope import fused_apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def rotated_by_hand(t, rotary_dim, interleaved, base=10000.0):
    s, d = t.size(0), rotary_dim
    out = t.clone().double()
    for i in range(d // 2):
        theta = torch.arange(s, dtype=torch.float64) * base ** (-2 * i / d)
        cos, sin = theta.cos()[:, None, None], theta.sin()[:, None, None]
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
        x, y = t[..., a].double(), t[..., b].double()
        out[..., a], out[..., b] = x * cos - y * sin, y * cos + x * sin
    return out


def _check(device, dtype, shape, rotary_percent, interleaved, atol):
    s, b, heads, d = shape
    freqs = RotaryEmbedding(d, rotary_percent, rotary_interleaved=interleaved, use_cpu_initialization=True)(s)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, dtype).requires_grad_(True)
    out = fused_apply_rotary_pos_emb(t, freqs, rotary_interleaved=interleaved)
    expected = rotated_by_hand(t.detach().cpu(), freqs.size(-1), interleaved)
    torch.testing.assert_close(out.detach().cpu().double(), expected, atol=atol, rtol=atol)
    # The rotation is orthogonal, so the gradient of sum(out * g) is the inverse rotation of g.
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out.backward(grad)
    reference = t.detach().cpu().double().requires_grad_(True)
    rotated_by_hand(reference, freqs.size(-1), interleaved).backward(grad.cpu().double())
    torch.testing.assert_close(t.grad.cpu().double(), reference.grad, atol=atol, rtol=atol)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rope_on_cpu(interleaved, rotary_percent):
    _check("cpu", torch.float32, (6, 2, 3, 8), rotary_percent, interleaved, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(64, 2, 8, 64), (33, 1, 4, 128)])
def test_rope_compiled_on_gpu(shape, interleaved):
    _check("cuda", torch.bfloat16, shape, 1.0, interleaved, 3e-2)
