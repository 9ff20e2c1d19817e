"""Ring attention (`cp_comm_type="p2p"`): the key/value blocks travel around the context-parallel ranks
while each rank keeps its own queries, and the partial outputs are merged with their log-sum-exps.

With the load-balanced split (batch_split.py) rank r of c holds chunks r and 2c-1-r of the sequence, n
tokens each: local rows [0, n) are chunk r and rows [n, 2n) chunk 2c-1-r. At ring step i it holds the
keys/values of rank src = (r - i) mod c, i.e. chunks src and 2c-1-src. For causal attention:

    i = 0 (src = r):  its own keys: the plain causal mask over the 2n local rows and columns
    src < r:          chunk src is earlier than both query chunks, chunk 2c-1-src later than both:
                      all 2n queries see the first n keys, unmasked
    src > r:          query chunk r precedes both key chunks and sees nothing; query chunk 2c-1-r follows
                      both: the last n queries see all 2n keys, unmasked

so every step costs the same n x 2n scores on every rank. Without a causal mask every step is 2n x 2n.

The partial outputs of the steps merge exactly with their log-sum-exps (online softmax,
block_attention.merge_partial), in fp32.

The backward is a custom autograd function (autograd through point-to-point sends would let ranks run
their sends in different orders). It runs the ring's steps in reverse, c-1 down to 0, with the blocks
travelling the other way (each rank sends to the previous rank and receives from the next): at step i the
rank holds block r - i again, computes with the final O and lse (block_attention.py) its query gradient
share and the gradient of that block, and adds the latter into the block's dK/dV accumulator, which
travels with the block and so ends at its owner at step 0, where the owner adds its own share last. Each
transfer (the next step's keys/values, the accumulator) runs during a step's computation; none is left
after the last one, which a forward-order replay has (the accumulators' hop home). The forward keeps the
block of its last step (block r + 1, one block of keys/values per layer more than its own) for the first
step of the backward; step 0's block is the rank's own. So the backward sends c - 2 key/value blocks and
c - 1 accumulators: at c = 2 one accumulator, hidden behind the diagonal block.

The accumulators (dq and dK/dV) are fp32, except at c <= 2 where the blocks' own 16-bit gradients (the fused
kernels') are added in their dtype (`accumulator_dtype`): each element then gets at most two shares, and a
16-bit addition computes in fp32 and rounds once, which is what an fp32 sum rounded at the end gives, bit for
bit. That saves three passes over an fp32 dq (write, add, cast), halves the accumulator sent and the adds
(7.5 ms of fp32 additions and 3.2 ms of casts a step on a CP=2 rank of a 12-layer GPT at sequence 32768).
"""

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.block_attention import (
    block_attention_backward,
    block_attention_forward,
    dropout_masks,
    merge_partial,
)


class _RingNeighbours:
    """Sends a tensor to the next rank of the ring and receives one from the previous rank, asynchronously."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        position = ranks.index(dist.get_rank())
        self.group, self.size, self.position = group, len(ranks), position
        self.next_rank, self.previous_rank = ranks[(position + 1) % len(ranks)], ranks[position - 1]

    def start(self, tensor: torch.Tensor, backwards: bool = False):
        """(received buffer, pending requests): call `finish(requests)` before reading the buffer. `backwards`
        sends to the previous rank and receives from the next."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        to_rank, from_rank = (self.previous_rank, self.next_rank) if backwards else (self.next_rank, self.previous_rank)
        operations = [
            dist.P2POp(dist.isend, tensor, to_rank, self.group),
            dist.P2POp(dist.irecv, received, from_rank, self.group),
        ]
        return received, dist.batch_isend_irecv(operations)

    @staticmethod
    def finish(requests) -> None:
        for request in requests:
            request.wait()


def _step_blocks(step: int, neighbours: _RingNeighbours, causal: bool, n: int):
    """(query rows, key columns, causal offset or None) that ring step `step` computes (module docstring)."""
    everything = slice(None)
    if not causal:
        return everything, everything, None
    source = (neighbours.position - step) % neighbours.size
    if step == 0:
        return everything, everything, 0
    if source < neighbours.position:
        return everything, slice(0, n), None
    return slice(n, 2 * n), everything, None


def accumulator_dtype(ring_size: int, block_dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring backward adds the blocks' gradients up in (module docstring)."""
    return block_dtype if ring_size <= 2 else torch.float32


def _write_on(whole: torch.Tensor, part: slice, block: torch.Tensor, dim: int) -> torch.Tensor:
    """Writes `block` into `part` of dimension `dim` of `whole` (a part that starts at 0 or runs to the end) and
    zeros into the rest; returns `whole`."""
    if part == slice(None):
        return whole.copy_(block)
    start, size = part.start or 0, block.size(dim)
    whole.narrow(dim, start, size).copy_(block)
    rest = (start + size, whole.size(dim) - start - size) if start == 0 else (0, start)
    whole.narrow(dim, *rest).zero_()
    return whole


class RingAttention(torch.autograd.Function):
    """q [b, g, r, 2n, d], k and v [b, g, 1, 2n, d] (this rank's two chunks) -> O [b, g, r, 2n, d].
    Attention dropout with probability `dropout_p` draws its masks from `seed`, block after block;
    `use_cudnn=False` keeps cuDNN's kernel out of the blocks (block_attention.py)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool, group, dropout_p: float = 0.0, seed: int | None = None,
                use_cudnn: bool = True):
        neighbours = _RingNeighbours(group)
        dropout = dropout_masks(dropout_p, seed, q.device)
        n = q.size(-2) // 2
        key_values = torch.stack((k, v))  # [2, b, g, 1, 2n, d]: one message per step
        out = lse = None
        for step in range(neighbours.size):
            if step + 1 < neighbours.size:
                incoming, requests = neighbours.start(key_values)
            rows, columns, offset = _step_blocks(step, neighbours, causal, n)
            if dropout is not None:
                dropout.begin_block()
            block_out, block_lse = block_attention_forward(
                q[..., rows, :], key_values[0][..., columns, :], key_values[1][..., columns, :], scale, offset, dropout,
                use_cudnn,
            )
            if step == 0:  # step 0 covers every row, so each row has a finite lse from here on
                out, lse = block_out, block_lse
            else:
                merge_partial(out, lse, rows, block_out, block_lse)
            if step + 1 < neighbours.size:
                neighbours.finish(requests)
                key_values = incoming
        out = out.to(q.dtype)
        last_key_values = key_values if neighbours.size > 1 else None  # the backward's first block
        ctx.save_for_backward(q, k, v, out, lse, last_key_values)
        ctx.scale, ctx.causal, ctx.group, ctx.dropout, ctx.use_cudnn = scale, causal, group, dropout, use_cudnn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_values = ctx.saved_tensors
        neighbours = _RingNeighbours(ctx.group)
        n = q.size(-2) // 2
        if key_values is None:  # one rank: its own block only
            key_values = (k, v)
        dq = grads = None  # the query gradient; the held block's dK/dV accumulator
        incoming_grads = grad_requests = None  # the accumulator of the next step's block, on its way
        for step in reversed(range(neighbours.size)):
            requests = None
            if step > 1:  # step - 1's block comes from the next rank; step 0's is this rank's own
                incoming, requests = neighbours.start(key_values, backwards=True)
            rows, columns, offset = _step_blocks(step, neighbours, ctx.causal, n)
            dropout = None if ctx.dropout is None else ctx.dropout.replay_block(step)
            block_dq, block_dk, block_dv = block_attention_backward(
                dout[..., rows, :], q[..., rows, :], key_values[0][..., columns, :], key_values[1][..., columns, :],
                out[..., rows, :], lse[..., rows], ctx.scale, offset, dropout, ctx.use_cudnn,
            )
            if dq is None:
                dq = _write_on(torch.empty(q.shape, dtype=accumulator_dtype(neighbours.size, block_dq.dtype),
                                           device=q.device), rows, block_dq, dim=-2)
            else:
                dq[..., rows, :] += block_dq
            if grad_requests is None:  # the block's first share (step c - 1)
                grads = torch.empty((2,) + k.shape, dtype=accumulator_dtype(neighbours.size, block_dk.dtype),
                                    device=k.device)
                _write_on(grads[0], columns, block_dk, dim=-2)
                _write_on(grads[1], columns, block_dv, dim=-2)
            else:  # the shares of the ranks that held it before, from the next rank
                neighbours.finish(grad_requests)
                grads = incoming_grads
                grads[0][..., columns, :] += block_dk
                grads[1][..., columns, :] += block_dv
            if step > 0:
                incoming_grads, grad_requests = neighbours.start(grads, backwards=True)
            if requests is not None:
                neighbours.finish(requests)
                key_values = incoming
            elif step == 1:
                key_values = (k, v)  # step 0: this rank's own block, sent nowhere
        dk, dv = grads  # step 0: this rank's own block, every share added
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None
