"""Attention of one block of queries on one block of keys/values, with each row's log-sum-exp, and the
matching backward: the piece that ring and all-gather context parallelism are assembled from.

Shapes: q [b, g, r, sq, d] (g key/value groups, r query heads per group: query head g*r + i uses key/value
head g, so grouped-query attention needs no copies of K and V), k and v [b, g, 1, sk, d]. For query row i
and key column j (masked to -inf where j > i + causal_offset when a causal offset is given):

    S_ij = scale * q_i . k_j        lse_i = log sum_j exp(S_ij)        O_i = sum_j exp(S_ij - lse_i) v_j

The backward is FlashAttention-2's. Given the output O and log-sum-exp L of the WHOLE attention of each
row (all key blocks merged), P_ij = exp(S_ij - L_i) is the final attention probability, so every key block
yields its share of the gradient on its own:

    D_i = dO_i . O_i     dV_j = sum_i P_ij dO_i     dS_ij = P_ij (dO_i . v_j - D_i)
    dQ_i = scale * sum_j dS_ij k_j                   dK_j = scale * sum_i dS_ij q_i

Attention dropout multiplies P by a keep mask M / (1 - p) before V. It does not touch lse, and merging
blocks is linear in O, so the merged output is dropout(P) V of the whole attention. The backward then uses
dV_j = sum_i P_ij M_ij/(1-p) dO_i and dS_ij = P_ij (M_ij/(1-p) dO_i . v_j - D_i), with D_i = dO_i . O_i of
the dropped-out O (FlashAttention's rule). The masks are not stored: `DropoutMasks` draws them from a
generator seeded per call, and the backward replays the same draws in the same order.

Everything is computed in fp32, in tiles of query rows so that at most ~TILE_ELEMENTS scores exist at a time
(memory linear in the sequence, like a fused kernel, instead of the full [sq, sk] matrix). For bf16/fp16
inputs on a GPU the fp32 matmuls may use TF32 tensor cores: bf16 and fp16 values are exact in TF32, products
accumulate in fp32, and the probabilities keep 10 mantissa bits where FlashAttention rounds them to bf16.
"""

import contextlib

import torch

TILE_ELEMENTS = 1 << 24  # scores per tile: 64 MiB in fp32


def grouped_queries(query: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[s, b, np, d] -> [b, g, np/g, s, d]: query head i belongs to key/value group i // (np/g)."""
    s, b, heads, d = query.shape
    return query.permute(1, 2, 0, 3).reshape(b, num_groups, heads // num_groups, s, d)


def grouped_keys(key: torch.Tensor) -> torch.Tensor:
    """[s, b, g, d] -> [b, g, 1, s, d]."""
    return key.permute(1, 2, 0, 3).unsqueeze(2)


def ungrouped_output(out: torch.Tensor) -> torch.Tensor:
    """[b, g, r, s, d] -> [s, b, g*r*d]: the context layer's layout."""
    b, g, r, s, d = out.shape
    return out.reshape(b, g * r, s, d).permute(2, 0, 1, 3).reshape(s, b, g * r * d)


class DropoutMasks:
    """The attention-dropout keep masks, scaled by 1/(1-p), of one attention call, drawn in order from a
    generator seeded with `seed`: a second instance with the same seed yields the same sequence of masks."""

    def __init__(self, probability: float, seed: int, device: torch.device):
        self.probability = probability
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def next(self, shape, device) -> torch.Tensor:
        keep = torch.rand(shape, generator=self.generator, device=device) >= self.probability
        return keep.float() / (1.0 - self.probability)


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


def block_attention_forward(q, k, v, scale: float, causal_offset: int | None = None, dropout: DropoutMasks = None):
    """(O [b, g, r, sq, d], lse [b, g, r, sq]), both fp32. `causal_offset` c lets row i see columns 0 .. i + c
    (0: the usual causal mask of a diagonal block; None: no mask). Every row must see at least one column."""
    with _kernel_precision(q.dtype, q.device):
        return _block_attention_forward(q.float(), k.float(), v.float(), scale, causal_offset, dropout)


def _block_attention_forward(q, k, v, scale, causal_offset, dropout):
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


def block_attention_backward(
    dout, q, k, v, out, lse, scale: float, causal_offset: int | None = None, dropout: DropoutMasks = None
):
    """(dq [b, g, r, sq, d], dk [b, g, 1, sk, d], dv [b, g, 1, sk, d]) in fp32: this key block's share of
    the gradient, given the gradient `dout` of the output and the merged output `out` and `lse` of the
    rows (those of the whole attention, not of this block alone). `dropout` must replay the forward's."""
    with _kernel_precision(q.dtype, q.device):
        return _block_attention_backward(
            dout.float(), q.float(), k.float(), v.float(), out, lse, scale, causal_offset, dropout
        )


def _block_attention_backward(dout, q, k, v, out, lse, scale, causal_offset, dropout):
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


def dropout_masks(dropout_p: float, seed: int | None, device: torch.device) -> DropoutMasks | None:
    """The masks of one call (None without dropout)."""
    return DropoutMasks(dropout_p, seed, device) if dropout_p > 0 else None


class BlockAttention(torch.autograd.Function):
    """Autograd wrapper of one block whose rows see all their keys here (their lse is final):
    q [b, g, r, sq, d], k and v [b, g, 1, sk, d] -> O [b, g, r, sq, d] in q's dtype. Attention dropout with
    probability `dropout_p` draws its masks from `seed`."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal_offset, dropout_p: float = 0.0, seed: int | None = None):
        out, lse = block_attention_forward(q, k, v, scale, causal_offset, dropout_masks(dropout_p, seed, q.device))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal_offset, ctx.dropout_p, ctx.seed = scale, causal_offset, dropout_p, seed
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dropout = dropout_masks(ctx.dropout_p, ctx.seed, q.device)
        dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, ctx.scale, ctx.causal_offset, dropout)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
