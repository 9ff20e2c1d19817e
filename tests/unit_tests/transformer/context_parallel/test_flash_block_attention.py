"""The fused-kernel paths of block_attention.py against the tiled path and plain attention.

Each test runs three times:
- "cpu" (CI): fp32 on the CPU, with PyTorch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`
  and its backward) in place of the CUDA one, so that everything around the kernel (the split of an offset
  causal block into two calls, the merge, grouped heads, dq/dk/dv assembly, the ring order) is tested
  here. Tolerance 1e-5 relative to the largest entry.
- "cuda-cudnn" and "cuda-flash" (`@pytest.mark.gpu`): bf16 through the real CUDA kernels, cuDNN's (which
  must be the one chosen on sm90+) and FlashAttention-2 (cuDNN's turned off). Tolerance 3e-2 relative to the
  largest entry (bf16 keeps 8 bits: the kernel rounds P, O and the gradients to bf16, the references compute
  in fp32 from the same bf16 inputs; the CPU kernel in bf16 stays within 9e-3 on these cases, a wrong mask
  or a lost piece is off by 0.5 and more).
The references are plain softmax(QK^T * scale + mask) V in fp32 (blocks) and SDPA on the whole sequence (ring).
"""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.context_parallel import block_attention
from megatron.core.transformer.context_parallel.batch_split import chunks_of_cp_rank
from megatron.core.transformer.context_parallel.block_attention import (
    BlockAttention,
    block_attention_backward,
    block_attention_forward,
    merge_partial,
)
from megatron.core.transformer.context_parallel.ring_attention import _step_blocks
from megatron.core.transformer.context_parallel.tiled_block_attention import tiled_backward, tiled_forward

BF16_TOLERANCE = 3e-2
_GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cpu_forward_kernel(q, k, v, scale, causal, dropout_p):
    assert dropout_p == 0.0, "the CPU kernel stands in without dropout only"
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, (None, None)


def _cpu_backward_kernel(dout, q, k, v, out, lse, scale, causal, dropout_p, philox):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


@pytest.fixture(params=["cpu", pytest.param("cuda-cudnn", marks=_GPU_MARKS),
                        pytest.param("cuda-flash", marks=_GPU_MARKS)])
def kernel(request, monkeypatch):
    """(device, dtype, tolerance, the fused kernel that must run); on the CPU the CPU flash kernel stands in
    for the CUDA one."""
    if request.param == "cpu":
        monkeypatch.setattr(block_attention, "_flash_kernel_takes", lambda q, k, v: True)
        monkeypatch.setattr(block_attention, "_flash_forward_kernel", _cpu_forward_kernel)
        monkeypatch.setattr(block_attention, "_flash_backward_kernel", _cpu_backward_kernel)
        return "cpu", torch.float32, 1e-5, "flash"
    if request.param == "cuda-flash":
        monkeypatch.setattr(block_attention, "_cudnn_kernel_takes", lambda q, dropout: False)
        return "cuda", torch.bfloat16, BF16_TOLERANCE, "flash"
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN's attention kernel is used from sm90 on")
    return "cuda", torch.bfloat16, BF16_TOLERANCE, "cudnn"


def _assert_close(got, want, tolerance, what):
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error < tolerance, f"{what}: worst error {error:.3g} of the largest entry"


def _random(shape, device, dtype, generator):
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype).requires_grad_()


def _plain_attention(q, k, v, scale, causal_offset):
    """fp32 softmax(QK^T * scale + mask) V: q [b, g, r, sq, d], k and v [b, g, 1, sk, d]."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if causal_offset is not None:
        rows, columns = torch.arange(q.size(-2), device=q.device), torch.arange(k.size(-2), device=q.device)
        scores = scores.masked_fill(columns[None, :] > rows[:, None] + causal_offset, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()


# (groups, query heads per group, query rows, keys, causal offset, head dim)
BLOCKS = {
    "causal diagonal": (2, 2, 96, 96, 0, 64),
    "full block, more keys": (2, 2, 48, 96, None, 128),
    "second-half queries on all keys": (1, 4, 48, 96, None, 64),
    "all queries on first-half keys": (4, 1, 96, 48, None, 128),
    "all-gather chunk (offset sk - sq)": (2, 2, 32, 96, 64, 64),
}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_flash_block_equals_tiled_block_and_plain_attention(kernel, case):
    """One block whose rows see all their keys: O and lse of the forward, and dq/dk/dv, on both paths."""
    device, dtype, tolerance, fused = kernel
    groups, per_group, rows, keys, offset, head_dim = BLOCKS[case]
    generator = torch.Generator().manual_seed(7)
    q = _random((2, groups, per_group, rows, head_dim), device, dtype, generator)
    k, v = (_random((2, groups, 1, keys, head_dim), device, dtype, generator) for _ in range(2))
    dout = torch.randn(q.shape, generator=generator).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    assert block_attention._fused_kernel(q, k, v, offset, None, use_cudnn=True) == fused

    reference = _plain_attention(q, k, v, scale, offset)
    reference_grads = torch.autograd.grad(reference, (q, k, v), dout.float())
    with torch.no_grad():  # as inside the autograd Functions that call the block functions
        out, lse = block_attention_forward(q, k, v, scale, offset)
        tiled_out, tiled_lse = tiled_forward(q, k, v, scale, offset, None)
        grads = block_attention_backward(dout, q, k, v, out.to(dtype), lse, scale, offset)
        tiled_grads = tiled_backward(dout, q, k, v, tiled_out, tiled_lse, scale, offset, None)
    _assert_close(out, reference, tolerance, "O vs plain")
    _assert_close(out, tiled_out, tolerance, "O vs tiles")
    _assert_close(lse, tiled_lse, tolerance, "lse vs tiles")
    for name, got, tiled, want in zip("qkv", grads, tiled_grads, reference_grads):
        assert got.shape == want.shape
        _assert_close(got, want, tolerance, f"d{name} vs plain")
        _assert_close(got, tiled, tolerance, f"d{name} vs tiles")


@pytest.mark.parametrize("causal", [False, True])
def test_flash_block_takes_the_models_strided_layout(kernel, causal):
    """Queries, keys and values as the model hands them over (views of [s, b, heads, d]) and row / column
    slices of those (a ring step's block) give the results of their dense copies: the kernels read the strides."""
    device, dtype, tolerance, fused = kernel
    generator = torch.Generator().manual_seed(11)
    s, b, groups, per_group, d = 192, 2, 2, 2, 64
    query = torch.randn(s, b, groups * per_group, d, generator=generator).to(device=device, dtype=dtype)
    key, value = (torch.randn(s, b, groups, d, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
    q = block_attention.grouped_queries(query, groups)[..., s // 2:, :]  # the second half of the rows
    k, v = (block_attention.grouped_keys(t) for t in (key, value))
    if not causal:
        k, v = k[..., : s // 2, :], v[..., : s // 2, :]  # the first half of the keys
    offset = s - s // 2 if causal else None
    assert not q.is_contiguous() and not k.is_contiguous()
    dout = torch.randn(s, b, groups * per_group, d, generator=generator).to(device=device, dtype=dtype)
    dout = block_attention.grouped_queries(dout, groups)[..., s // 2:, :]
    assert block_attention._fused_kernel(q, k, v, offset, None, use_cudnn=True) == fused
    results = []
    for tensors in ((q, k, v, dout), tuple(t.contiguous() for t in (q, k, v, dout))):
        with torch.no_grad():
            out, lse = block_attention_forward(*tensors[:3], d**-0.5, offset)
            grads = block_attention_backward(tensors[3], *tensors[:3], out.to(dtype), lse, d**-0.5, offset)
        results.append((out, lse, *grads))
    for name, strided, dense in zip(("O", "lse", "dq", "dk", "dv"), *results):
        _assert_close(strided, dense, tolerance / 3, name)


def _ring_on_one_device(q, k, v, dout, cp_size, scale):
    """Ring attention of `cp_size` ranks, one rank after the other on one device: each rank's two chunks of
    queries against the key/value blocks of ring steps 0 .. c-1, with the block functions in the order and on
    the rows/columns of ring_attention.py, merged; then the backward with the merged O and lse. Returns
    O, dq, dk, dv of the whole sequence, in sequence order."""
    n = q.size(-2) // (2 * cp_size)

    def positions(rank):
        return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks_of_cp_rank(rank, cp_size)]).to(q.device)

    whole_out, dq_all = torch.zeros(q.shape, device=q.device), torch.zeros(q.shape, device=q.device)
    dk_all, dv_all = torch.zeros(k.shape, device=q.device), torch.zeros(k.shape, device=q.device)
    for rank in range(cp_size):
        mine = positions(rank)
        ring = SimpleNamespace(position=rank, size=cp_size)
        steps = [(positions((rank - step) % cp_size), *_step_blocks(step, ring, True, n)) for step in range(cp_size)]
        out = lse = None
        for theirs, rows, columns, offset in steps:
            block_out, block_lse = block_attention_forward(
                q[..., mine[rows], :], k[..., theirs[columns], :], v[..., theirs[columns], :], scale, offset
            )
            if out is None:
                out, lse = block_out, block_lse
            else:
                merge_partial(out, lse, rows, block_out, block_lse)
        out = out.to(q.dtype)
        whole_out[..., mine, :] = out.float()
        for theirs, rows, columns, offset in steps:
            dq, dk, dv = block_attention_backward(
                dout[..., mine[rows], :], q[..., mine[rows], :], k[..., theirs[columns], :],
                v[..., theirs[columns], :], out[..., rows, :], lse[..., rows], scale, offset,
            )
            dq_all[..., mine[rows], :] += dq.float()
            dk_all[..., theirs[columns], :] += dk.float()
            dv_all[..., theirs[columns], :] += dv.float()
    return whole_out, dq_all, dk_all, dv_all


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_of_flash_blocks_equals_sdpa_on_the_whole_sequence(kernel, cp_size):
    """Causal GQA attention of one 256-token sequence, cut into 2 x CP chunks: forward and backward."""
    device, dtype, tolerance, fused = kernel
    generator = torch.Generator().manual_seed(3)
    q = _random((2, 2, 2, 256, 64), device, dtype, generator)
    k, v = (_random((2, 2, 1, 256, 64), device, dtype, generator) for _ in range(2))
    dout = torch.randn(q.shape, generator=generator).to(device=device, dtype=dtype)
    scale = 64**-0.5
    assert block_attention._fused_kernel(q[..., :128, :], k[..., :128, :], v[..., :128, :], 0, None, True) == fused
    with torch.no_grad():
        got = _ring_on_one_device(q, k, v, dout, cp_size, scale)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().expand(q.shape), v.float().expand(q.shape), is_causal=True, scale=scale
    )
    expected = [reference, *torch.autograd.grad(reference, (q, k, v), dout.float())]
    for name, actual, want in zip(("O", "dq", "dk", "dv"), got, expected):
        _assert_close(actual, want, tolerance, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_block_dropout_draws_from_its_seed_and_replays_in_the_backward():
    """p = 0.3, causal, GQA, bf16. A call with V = the identity (64 keys, head dim 64) returns the dropped-out
    probabilities, i.e. the keep mask; a second call with the same seed and a real V must equal, forward and
    backward, softmax(QK^T * scale + causal) * keep / (1 - p) V. The default CUDA generator is left as it was."""
    generator = torch.Generator().manual_seed(5)
    q = _random((1, 2, 2, 64, 64), "cuda", torch.bfloat16, generator)
    k, v = (_random((1, 2, 1, 64, 64), "cuda", torch.bfloat16, generator) for _ in range(2))
    dout = torch.randn(q.shape, generator=generator).to(device="cuda", dtype=torch.bfloat16)
    identity = torch.eye(64, device="cuda", dtype=torch.bfloat16).expand(1, 2, 1, 64, 64).contiguous()
    scale, probability, seed = 0.125, 0.3, 1234
    assert block_attention._runs_in_flash_kernel(q, k, v, 0)
    rng_before = torch.cuda.get_rng_state()

    readout = BlockAttention.apply(q.detach(), k.detach(), identity, scale, 0, probability, seed)
    visible = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    keep = (readout != 0).float()
    dropped = 1 - keep[..., visible].mean().item()
    assert 0.2 < dropped < 0.4, dropped

    out = BlockAttention.apply(q, k, v, scale, 0, probability, seed)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    probs = torch.softmax((q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~visible, float("-inf")), -1)
    reference = probs * keep / (1 - probability) @ v.float()
    reference_grads = torch.autograd.grad(reference, (q, k, v), dout.float())
    _assert_close(out, reference, BF16_TOLERANCE, "O")
    for name, got, want in zip("qkv", grads, reference_grads):
        _assert_close(got, want, BF16_TOLERANCE, f"d{name}")
    assert torch.equal(torch.cuda.get_rng_state(), rng_before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_block_memory_is_linear_in_the_sequence():
    """Forward + backward of a causal block of 16 heads, head dim 128: the peak memory above the inputs
    doubles (not quadruples) from 8192 to 16384 tokens, and at 16384 stays under 32 x the bytes of q (one
    head's [s, s] scores in bf16 alone would be 8 x)."""

    def peak_above_inputs(tokens):
        generator = torch.Generator().manual_seed(0)
        q = _random((1, 4, 4, tokens, 128), "cuda", torch.bfloat16, generator)  # 16 heads on 4 key/value heads
        k, v = (_random((1, 4, 1, tokens, 128), "cuda", torch.bfloat16, generator) for _ in range(2))
        dout = torch.randn(q.shape, generator=generator).to(device="cuda", dtype=torch.bfloat16)
        assert block_attention._runs_in_flash_kernel(q, k, v, 0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        BlockAttention.apply(q, k, v, 128**-0.5, 0).backward(dout)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, q.numel() * q.element_size()

    small, _ = peak_above_inputs(8192)
    large, q_bytes = peak_above_inputs(16384)
    assert large < 2.5 * small, (small, large)
    assert large < 32 * q_bytes, (large, q_bytes)
