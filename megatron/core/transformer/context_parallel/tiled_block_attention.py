"""The plain-PyTorch kernel of block_attention.py (its maths there): fp32 arithmetic in tiles of query rows,
so that at most ~TILE_ELEMENTS scores exist at a time (memory linear in the sequence, like a fused kernel,
instead of the full [sq, sk] matrix).

It serves fp32 inputs, CPUs, and whatever the fused flash kernel cannot take. For bf16/fp16 inputs on a GPU
the fp32 matmuls may use TF32 tensor cores: bf16 and fp16 values are exact in TF32, products accumulate in
fp32, and the probabilities keep 10 mantissa bits where FlashAttention rounds them to bf16. Attention
dropout draws its keep masks, tile after tile, from `dropout.next(shape, device)` (block_attention.DropoutMasks).
"""

import contextlib

import torch

TILE_ELEMENTS = 1 << 24  # scores per tile: 64 MiB in fp32


def _row_tiles(q: torch.Tensor, num_keys: int):
    """(first, last) query-row ranges of the tiles."""
    b, g, r, num_rows, _ = q.shape
    rows = max(1, min(num_rows, TILE_ELEMENTS // max(1, b * g * r * num_keys)))
    return [(first, min(first + rows, num_rows)) for first in range(0, num_rows, rows)]


def _scores(q_tile: torch.Tensor, k: torch.Tensor, scale: float, causal_offset, first_row: int) -> torch.Tensor:
    """[b, g, r, t, sk] scaled scores of query rows first_row .. first_row + t - 1, causally masked."""
    scores = torch.matmul(q_tile, k.transpose(-1, -2)) * scale
    if causal_offset is not None:
        rows = torch.arange(first_row, first_row + q_tile.size(-2), device=k.device)
        columns = torch.arange(k.size(-2), device=k.device)
        scores = scores.masked_fill(columns[None, :] > rows[:, None] + causal_offset, float("-inf"))
    return scores


@contextlib.contextmanager
def _kernel_precision(dtype: torch.dtype, device: torch.device):
    """fp32 arithmetic whatever autocast says; TF32 matmuls for half-precision inputs on CUDA (module
    docstring), full fp32 for fp32 inputs."""
    tf32 = dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
    previous = torch.get_float32_matmul_precision()
    with torch.autocast(device_type=device.type, enabled=False):
        if tf32:
            torch.set_float32_matmul_precision("high")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)


def tiled_forward(q, k, v, scale: float, causal_offset, dropout):
    """(O [b, g, r, sq, d], lse [b, g, r, sq]), both fp32 (block_attention_forward's contract)."""
    with _kernel_precision(q.dtype, q.device):
        q, k, v = q.float(), k.float(), v.float()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for first, last in _row_tiles(q, k.size(-2)):
            scores = _scores(q[..., first:last, :], k, scale, causal_offset, first)
            tile_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - tile_lse[..., None])
            if dropout is not None:
                probs = probs * dropout.next(probs.shape, probs.device)
            out[..., first:last, :] = torch.matmul(probs, v)
            lse[..., first:last] = tile_lse
        return out, lse


def tiled_backward(dout, q, k, v, out, lse, scale: float, causal_offset, dropout):
    """(dq, dk, dv) in fp32 (block_attention_backward's contract)."""
    with _kernel_precision(q.dtype, q.device):
        dout, q, k, v = dout.float(), q.float(), k.float(), v.float()
        delta = (dout * out.float()).sum(dim=-1)  # D_i [b, g, r, sq]
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for first, last in _row_tiles(q, k.size(-2)):
            q_tile, dout_tile = q[..., first:last, :], dout[..., first:last, :]
            probs = torch.exp(_scores(q_tile, k, scale, causal_offset, first) - lse[..., first:last, None])
            dprobs = torch.matmul(dout_tile, v.transpose(-1, -2))
            if dropout is None:
                dv += torch.matmul(probs.transpose(-1, -2), dout_tile).sum(dim=2, keepdim=True)
            else:
                keep = dropout.next(probs.shape, probs.device)
                dv += torch.matmul((probs * keep).transpose(-1, -2), dout_tile).sum(dim=2, keepdim=True)
                dprobs = dprobs * keep
            dscores = probs * (dprobs - delta[..., first:last, None])
            dq[..., first:last, :] = torch.matmul(dscores, k) * scale
            dk += torch.matmul(dscores.transpose(-1, -2), q_tile).sum(dim=2, keepdim=True) * scale
        return dq, dk, dv
