"""flash-attn in core attention, against the SDPA path, with a stand-in `flash_attn` module.

flash-attn is not installed here (nor on the GPU machines). The stand-in implements flash-attn 2's
documented `flash_attn_func` on its own ([b, s, heads, hn] in and out, key/value head i // (np/ng) for query
head i, causal mask aligned to the bottom-right corner), so these tests check what this framework owns: the
layout handling, the arguments and which calls go to flash-attn.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions.flash_attn import FlashAttention, describe, load_flash_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from .gradients import output_and_grads

SQ, SK, B, NP, NG, HN = 6, 9, 2, 4, 2, 8  # B != S and NP != NG, so a swapped axis cannot go unnoticed


def _stand_in_flash_attn(calls: list, version: str = "2.7.4") -> types.ModuleType:
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        b, sq, heads, hn = q.shape
        sk, groups = k.size(1), k.size(2)
        assert k.shape == v.shape == (b, sk, groups, hn) and heads % groups == 0
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # its one layout requirement
        calls.append({"shape": tuple(q.shape), "dropout_p": dropout_p, "causal": causal})
        group_of_head = torch.arange(heads, device=q.device) // (heads // groups)
        # [b, s, heads, hn] -> [b, heads, s, hn]
        qh, kh, vh = q.transpose(1, 2), k[:, :, group_of_head].transpose(1, 2), v[:, :, group_of_head].transpose(1, 2)
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal else None
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, dropout_p=dropout_p, scale=softmax_scale)
        return out.transpose(1, 2).contiguous()  # [b, sq, heads, hn]

    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_func = flash_attn_func
    return module


@pytest.fixture(autouse=True)
def _fresh_loader():
    load_flash_attention.cache_clear()
    yield
    load_flash_attention.cache_clear()


def _install(monkeypatch, module) -> None:
    """`module` becomes what `import flash_attn` finds (None: the import fails)."""
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    load_flash_attention.cache_clear()


def _attention(backend="auto", mask_type=AttnMaskType.causal, attention_type="self"):
    config = TransformerConfig(num_layers=2, hidden_size=NP * HN, num_attention_heads=NP, num_query_groups=NG,
                               attention_backend=backend, attention_dropout=0.0)
    return DotProductAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type=attention_type)


def _qkv(sq, sk, dtype=torch.float32, device="cpu", head_dim=HN):
    generator = torch.Generator().manual_seed(0)
    shapes = ((sq, B, NP, head_dim), (sk, B, NG, head_dim), (sk, B, NG, head_dim))
    return [torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_() for shape in shapes]


@pytest.mark.parametrize("causal, sq, sk, mask_type", [
    (True, SK, SK, AttnMaskType.causal),        # causal self-attention with GQA
    (False, SQ, SK, AttnMaskType.no_mask),      # unmasked cross-attention, sq != sk
])
def test_adapter_matches_the_sdpa_path(monkeypatch, causal, sq, sk, mask_type):
    _install(monkeypatch, None)
    sdpa = _attention(mask_type=mask_type, attention_type="self" if sq == sk else "cross")
    calls = []
    flash = FlashAttention(_stand_in_flash_attn(calls))
    inputs = _qkv(sq, sk)
    expected = output_and_grads(lambda q, k, v: sdpa(q, k, v, None), inputs)
    ours = output_and_grads(lambda q, k, v: flash(q, k, v, 0.0, sdpa.softmax_scale, causal), inputs)
    assert calls == [{"shape": (B, sq, NP, HN), "dropout_p": 0.0, "causal": causal}]
    assert ours[0].shape == (sq, B, NP * HN)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want)


def test_calls_flash_attn_cannot_take_say_why():
    flash = FlashAttention(_stand_in_flash_attn([]))
    q, k, _ = _qkv(SK, SK, torch.bfloat16)
    assert flash.unsupported_reason(q, k, masked=True, causal=False) == "an explicit attention mask"
    q_short, _, _ = _qkv(SQ, SK, torch.bfloat16)
    assert "bottom-right" in flash.unsupported_reason(q_short, k, masked=False, causal=True)
    assert flash.unsupported_reason(q_short, k, masked=False, causal=False) == "a cpu device (needs CUDA)"
    q32, k32, _ = _qkv(SK, SK)
    assert flash.unsupported_reason(q32, k32, False, True) == "torch.float32 inputs (needs float16 or bfloat16)"
    for head_dim in (12, 264):
        q_odd, k_odd, _ = _qkv(SK, SK, torch.bfloat16, head_dim=head_dim)
        reason = flash.unsupported_reason(q_odd, k_odd, False, True)
        assert reason == f"head dim {head_dim} (needs a multiple of 8 up to 256)"
    assert flash.unsupported_reason(q, k, masked=False, causal=True) == "a cpu device (needs CUDA)"


def test_on_a_cpu_the_sdpa_path_runs_even_with_flash_attn_installed(monkeypatch):
    _install(monkeypatch, None)
    inputs = _qkv(SK, SK, torch.bfloat16)
    expected = output_and_grads(lambda q, k, v: _attention()(q, k, v, None), inputs)
    calls = []
    _install(monkeypatch, _stand_in_flash_attn(calls))
    attention = _attention()
    assert attention.flash_attention is not None and attention.flash_attention.version == "2.7.4"
    ours = output_and_grads(lambda q, k, v: attention(q, k, v, None), inputs)
    assert calls == []
    for got, want in zip(ours, expected):
        assert torch.equal(got, want)


def test_loaded_for_auto_and_flash_only_and_only_from_flash_attn_2(monkeypatch, caplog):
    _install(monkeypatch, _stand_in_flash_attn([]))
    assert [_attention(backend).flash_attention is not None for backend in ("auto", "flash", "fused", "unfused")] == [
        True, True, False, False]
    assert describe("torch SDPA").startswith("flash-attn 2.7.4 for fp16/bf16 on CUDA")
    _install(monkeypatch, None)
    assert load_flash_attention() is None and describe("torch SDPA") == "torch SDPA; flash-attn not installed"
    old = types.ModuleType("flash_attn")
    old.__version__ = "1.0.9"
    _install(monkeypatch, old)
    assert load_flash_attention() is None
    assert "no flash-attn 2 `flash_attn_func`" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attn_takes_qualifying_calls_on_gpu(monkeypatch):
    _install(monkeypatch, None)
    inputs = _qkv(SK, SK, torch.bfloat16, "cuda")
    expected = output_and_grads(lambda q, k, v: _attention()(q, k, v, None), inputs)
    calls = []
    _install(monkeypatch, _stand_in_flash_attn(calls))
    attention = _attention()
    ours = output_and_grads(lambda q, k, v: attention(q, k, v, None), inputs)
    assert calls == [{"shape": (B, SK, NP, HN), "dropout_p": 0.0, "causal": True}]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)  # bf16, two SDPA kernels
    mask = torch.zeros(B, 1, SK, SK, dtype=torch.bool, device="cuda")
    attention(*inputs, mask)
    assert len(calls) == 1  # an explicit mask stays with SDPA
