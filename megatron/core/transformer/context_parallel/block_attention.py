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

Partial results of the same rows on different key blocks merge exactly (online softmax, `merge_partial`):

    lse = log(exp(lse_a) + exp(lse_b))        O = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b

Attention dropout multiplies P by a keep mask M / (1 - p) before V. It does not touch lse, and merging
blocks is linear in O, so the merged output is dropout(P) V of the whole attention. The backward then uses
dV_j = sum_i P_ij M_ij/(1-p) dO_i and dS_ij = P_ij (M_ij/(1-p) dO_i . v_j - D_i), with D_i = dO_i . O_i of
the dropped-out O (FlashAttention's rule). The masks are not stored: `DropoutMasks` draws them from a
generator seeded per call, and the backward replays the same draws in the same order.

What runs where (`_fused_kernel`):

    CUDA (sm80+), bf16/fp16, head dim a multiple of 8 up to 256, no mask or a causal diagonal that ends at
    the last key (offset sk - sq >= 0, every block ring and all-gather attention use): a fused kernel that
    takes O and lse from outside in the backward exactly as above, nothing of size [sq, sk] in memory
    (O(b h s d)). Grouped queries go in as h = g*r heads on g key/value heads (the kernels' own GQA). A
    causal block with offset c > 0 is two calls, keys [0, c) unmasked and the square [c, sk) causal, merged:
    the kernels' `is_causal` is used on square blocks only (for sq != sk CUDA's FlashAttention-2 puts the
    diagonal bottom-right, cuDNN, SDPA and the CPU kernel top-left).
      cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention` and its `_backward`, what SDPA
        runs first): on sm90+ with cuDNN 9+, head dim up to 128, no dropout, SDPA's cuDNN backend enabled,
        unless the caller pins the flash kernel (`--attention-backend flash`). About 1.9x the speed of
        FlashAttention-2 on an H200 (GPT 1.3B heads at seq 16384: 6.4 against 12.4 ms forward + backward),
        which is what lets ring attention halve a layer's attention time at CP=2.
      PyTorch's FlashAttention-2 (`aten._scaled_dot_product_flash_attention` and its `_backward`) otherwise.
        Dropout: the kernel draws from the default CUDA generator, which `DropoutMasks` loads with its own
        seeded state around the call, and the backward hands the kernel the philox state that the forward
        recorded, so the masks replay exactly.
    everything else (fp32 inputs, CPUs, other head dims):
        plain PyTorch in fp32 tiles of query rows (tiled_block_attention.py), also linear in memory.
"""

import contextlib
import functools

import torch

from megatron.core.transformer.context_parallel.tiled_block_attention import tiled_backward, tiled_forward

_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_MAX_HEAD_DIM = 256
_CUDNN_MAX_HEAD_DIM = 128
_CUDNN_MIN_VERSION = 90000  # cuDNN 9.0


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
    """The attention-dropout masks of one attention call, all drawn from one generator seeded with `seed`.

    The tiles draw keep masks scaled by 1/(1-p) with `next`. The flash kernel draws its own from the default
    CUDA generator: `drawing_in_default_generator` lends it this generator's state for the call, and the
    kernel's philox states are kept in `kernel_states`, one list per block. `replay()` rewinds for the
    backward: the tiles draw the same masks again, in order, and `next_kernel_states()` returns the lists in
    the order the blocks ran. A caller whose backward visits its blocks in another order marks each block's
    start in forward (`begin_block`) and rewinds to it (`replay_block`).
    """

    def __init__(self, probability: float, seed: int, device: torch.device):
        self.probability, self.seed = probability, seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernel_states = []
        self._replayed_states = iter(())
        self._block_starts = []  # (generator state, kernel calls so far) at each begin_block

    def begin_block(self) -> None:
        self._block_starts.append((self.generator.get_state(), len(self.kernel_states)))

    def replay_block(self, index: int) -> "DropoutMasks":
        """Rewinds to the start of block `index` (the `index`-th begin_block of the forward)."""
        state, kernel_calls = self._block_starts[index]
        self.generator.set_state(state)
        self._replayed_states = iter(self.kernel_states[kernel_calls:])
        return self

    def next(self, shape, device) -> torch.Tensor:
        keep = torch.rand(shape, generator=self.generator, device=device) >= self.probability
        return keep.float() / (1.0 - self.probability)

    @contextlib.contextmanager
    def drawing_in_default_generator(self):
        device = self.generator.device
        saved = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(self.generator.get_state(), device)
        try:
            yield
        finally:
            self.generator.set_state(torch.cuda.get_rng_state(device))
            torch.cuda.set_rng_state(saved, device)

    def next_kernel_states(self) -> list:
        return next(self._replayed_states)

    def replay(self) -> "DropoutMasks":
        self.generator.manual_seed(self.seed)
        self._replayed_states = iter(self.kernel_states)
        return self


def dropout_masks(dropout_p: float, seed: int | None, device: torch.device) -> DropoutMasks | None:
    """The masks of one call (None without dropout)."""
    return DropoutMasks(dropout_p, seed, device) if dropout_p > 0 else None


def merge_partial(out, lse, rows, block_out, block_lse) -> None:
    """Online-softmax merge of a block's (O, lse) into the running fp32 ones, in place, on `rows`."""
    merged = torch.logaddexp(lse[..., rows], block_lse)
    out[..., rows, :] = (
        out[..., rows, :] * torch.exp(lse[..., rows] - merged)[..., None]
        + block_out * torch.exp(block_lse - merged)[..., None]
    )
    lse[..., rows] = merged


def _flash_kernel_takes(q, k, v) -> bool:
    """Whether PyTorch's fused flash kernels exist for these tensors: CUDA sm80+, bf16/fp16, head dim a
    multiple of 8 up to 256."""
    head_dim = q.size(-1)
    return (
        q.is_cuda and q.dtype in _FLASH_DTYPES and k.dtype == v.dtype == q.dtype
        and head_dim % 8 == 0 and head_dim <= _FLASH_MAX_HEAD_DIM
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def _runs_in_flash_kernel(q, k, v, causal_offset) -> bool:
    """Whether this block runs in a fused kernel (module docstring): they take the tensors, and the mask is
    none or a causal diagonal that ends at the last key."""
    return _flash_kernel_takes(q, k, v) and (causal_offset is None or causal_offset == k.size(-2) - q.size(-2) >= 0)


@functools.cache
def _cudnn_device(device: torch.device) -> bool:
    """Whether `device` (CUDA) has cuDNN's fused attention: sm90+ and cuDNN 9+; asked once per device."""
    return (torch.cuda.get_device_capability(device) >= (9, 0) and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.version() >= _CUDNN_MIN_VERSION)


def _cudnn_kernel_takes(q, dropout) -> bool:
    """Whether cuDNN's fused attention takes a block that the flash kernel takes (module docstring)."""
    return (
        q.is_cuda and dropout is None and q.size(-1) <= _CUDNN_MAX_HEAD_DIM and _cudnn_device(q.device)
        and torch.backends.cuda.cudnn_sdp_enabled()
    )


def _fused_kernel(q, k, v, causal_offset, dropout, use_cudnn: bool) -> str | None:
    """"cudnn", "flash" or None (the fp32 tiles): which kernel runs this block."""
    if not _runs_in_flash_kernel(q, k, v, causal_offset):
        return None
    return "cudnn" if use_cudnn and _cudnn_kernel_takes(q, dropout) else "flash"


def describe_kernels(use_cudnn: bool) -> str:
    """One line for the start-up banner: which kernels the blocks run in (module docstring)."""
    fused = "PyTorch's FlashAttention-2 (bf16/fp16, head dim up to 256)"
    if use_cudnn:
        fused = f"cuDNN's fused attention (sm90+, head dim up to 128, no attention dropout), else {fused}"
    return f"{fused}, else fp32 tiles in plain PyTorch"


def _flash_pieces(num_rows: int, num_keys: int, causal: bool) -> list[tuple[slice, bool]]:
    """(key columns, is_causal) of the kernel calls of one block; a causal block's diagonal ends at the last
    key: columns [0, sk - sq) unmasked, then the square [sk - sq, sk) causal (module docstring)."""
    if not causal:
        return [(slice(0, num_keys), False)]
    offset = num_keys - num_rows
    return ([(slice(0, offset), False)] if offset > 0 else []) + [(slice(offset, num_keys), True)]


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[b, g, r, s, d] -> [b, g*r, s, d] with unit stride along d (the kernel's requirement)."""
    t = t.flatten(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_forward_kernel(q, k, v, scale: float, causal: bool, dropout_p: float):
    """q [b, h, sq, d], k and v [b, hk, sk, d] (hk divides h) -> (O [b, h, sq, d] in q's dtype,
    lse [b, h, sq] fp32, the philox state (seed, offset) that its dropout used)."""
    out, lse, _, _, _, _, philox_seed, philox_offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, causal, False, scale=scale
    )
    return out, lse, (philox_seed, philox_offset)


def _flash_backward_kernel(dout, q, k, v, out, lse, scale: float, causal: bool, dropout_p: float, philox):
    """(dq [b, h, sq, d], dk and dv [b, hk, sk, d]) in q's dtype. `lse` must be contiguous [b, h, sq]: the
    kernel reads it without strides. `philox` is the forward's (seed, offset); unused without dropout."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), dropout_p, causal, *philox, scale=scale
    )


def _cudnn_forward_kernel(q, k, v, scale: float, causal: bool, dropout_p: float):
    """_flash_forward_kernel's contract in cuDNN's kernel (no dropout: `_cudnn_kernel_takes`). q, k and v go in
    with the strides they have (the model's [s, b, h, d] order, a ring step's row or column slice of it): cuDNN's
    graph takes each tensor's strides, and copying them densely cost a CP=2 rank 9.5 ms a step at sequence 32768
    (2.7% of it)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, dropout_p, causal, False, scale=scale
    )
    return out, lse.squeeze(-1), None  # cuDNN's lse is [b, h, sq, 1]


def _cudnn_backward_kernel(dout, q, k, v, out, lse, scale: float, causal: bool, dropout_p: float, philox):
    """_flash_backward_kernel's contract in cuDNN's kernel; no bias, no variable lengths (None: undefined).
    Strided inputs as in the forward (PyTorch lays dout out as out before cuDNN reads it); lse dense."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), *philox, None, None, None, q.size(2), k.size(2),
        dropout_p, causal, scale=scale,
    )


def _fused_forward(q, k, v, scale, causal_offset, dropout, kernel: str):
    """block_attention_forward in the fused `kernel` ("cudnn" or "flash"): one call per piece, merged in fp32."""
    forward_kernel = _cudnn_forward_kernel if kernel == "cudnn" else _flash_forward_kernel
    _, g, r, num_rows, _ = q.shape
    heads, keys, values = (_heads_first(t) for t in (q, k, v))
    dropout_p = 0.0 if dropout is None else dropout.probability
    out = lse = None
    states = []
    for columns, causal in _flash_pieces(num_rows, keys.size(2), causal_offset is not None):
        with contextlib.nullcontext() if dropout is None else dropout.drawing_in_default_generator():
            piece_out, piece_lse, philox = forward_kernel(
                heads, keys[:, :, columns], values[:, :, columns], scale, causal, dropout_p
            )
        states.append(philox)
        piece_out, piece_lse = piece_out.float().unflatten(1, (g, r)), piece_lse.unflatten(1, (g, r))
        if out is None:
            out, lse = piece_out, piece_lse
        else:
            merge_partial(out, lse, slice(None), piece_out, piece_lse)
    if dropout is not None:
        dropout.kernel_states.append(states)
    return out, lse


def _fused_backward(dout, q, k, v, out, lse, scale, causal_offset, dropout, kernel: str):
    """block_attention_backward in the fused `kernel`: the pieces' dq summed, their dk and dv side by side."""
    backward_kernel = _cudnn_backward_kernel if kernel == "cudnn" else _flash_backward_kernel
    _, g, r, num_rows, _ = q.shape
    heads, keys, values, dout_heads, out_heads = (_heads_first(t.to(q.dtype)) for t in (q, k, v, dout, out))
    lse = lse.flatten(1, 2).contiguous()
    pieces = _flash_pieces(num_rows, keys.size(2), causal_offset is not None)
    if dropout is None:
        no_state = torch.empty(0, dtype=torch.int64, device=q.device)
        dropout_p, states = 0.0, [(no_state, no_state)] * len(pieces)
    else:
        dropout_p, states = dropout.probability, dropout.next_kernel_states()
    dq, dk, dv = None, [], []
    for (columns, causal), philox in zip(pieces, states):
        piece_dq, piece_dk, piece_dv = backward_kernel(
            dout_heads, heads, keys[:, :, columns], values[:, :, columns], out_heads, lse, scale, causal,
            dropout_p, philox,
        )
        dq = piece_dq if dq is None else dq.float() + piece_dq  # the pieces' key columns are disjoint
        dk.append(piece_dk)
        dv.append(piece_dv)
    dk, dv = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2) for parts in (dk, dv))  # no copy of one
    return dq.unflatten(1, (g, r)), dk.unsqueeze(2), dv.unsqueeze(2)


def block_attention_forward(
    q, k, v, scale: float, causal_offset: int | None = None, dropout: DropoutMasks = None, use_cudnn: bool = True
):
    """(O [b, g, r, sq, d], lse [b, g, r, sq]), both fp32. `causal_offset` c lets row i see columns 0 .. i + c
    (0: the usual causal mask of a diagonal block; None: no mask). Every row must see at least one column.
    `use_cudnn=False` keeps cuDNN's kernel out (module docstring)."""
    kernel = _fused_kernel(q, k, v, causal_offset, dropout, use_cudnn)
    if kernel is not None:
        with torch.autocast(device_type=q.device.type, enabled=False):
            return _fused_forward(q, k, v, scale, causal_offset, dropout, kernel)
    return tiled_forward(q, k, v, scale, causal_offset, dropout)


def block_attention_backward(
    dout, q, k, v, out, lse, scale: float, causal_offset: int | None = None, dropout: DropoutMasks = None,
    use_cudnn: bool = True,
):
    """(dq [b, g, r, sq, d], dk [b, g, 1, sk, d], dv [b, g, 1, sk, d]), fp32 from the tiles, q's dtype (or
    fp32) from a fused kernel: this key block's share of the gradient, given the gradient `dout` of the
    output and the merged output `out` and `lse` of the rows (those of the whole attention, not of this block
    alone). `dropout` must be the forward's, replayed (`DropoutMasks.replay`); `use_cudnn` the forward's."""
    kernel = _fused_kernel(q, k, v, causal_offset, dropout, use_cudnn)
    if kernel is not None:
        with torch.autocast(device_type=q.device.type, enabled=False):
            return _fused_backward(dout, q, k, v, out, lse, scale, causal_offset, dropout, kernel)
    return tiled_backward(dout, q, k, v, out, lse, scale, causal_offset, dropout)


class BlockAttention(torch.autograd.Function):
    """Autograd wrapper of one block whose rows see all their keys here (their lse is final):
    q [b, g, r, sq, d], k and v [b, g, 1, sk, d] -> O [b, g, r, sq, d] in q's dtype. Attention dropout with
    probability `dropout_p` draws its masks from `seed`; `use_cudnn=False` keeps cuDNN's kernel out."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal_offset, dropout_p: float = 0.0, seed: int | None = None,
                use_cudnn: bool = True):
        dropout = dropout_masks(dropout_p, seed, q.device)
        out, lse = block_attention_forward(q, k, v, scale, causal_offset, dropout, use_cudnn)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal_offset, ctx.dropout, ctx.use_cudnn = scale, causal_offset, dropout, use_cudnn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dropout = None if ctx.dropout is None else ctx.dropout.replay()
        dq, dk, dv = block_attention_backward(
            dout, q, k, v, out, lse, ctx.scale, ctx.causal_offset, dropout, ctx.use_cudnn
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
