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
their sends in different orders). It replays the ring: at step i the rank computes, with the final O and
lse (block_attention.py), its query gradient share and the gradient of the key/value block it holds; that
block's dK/dV accumulator travels with it around the ring (received from the previous rank, which held
the same block one step earlier) and comes home after the last step. The transfer of step i + 1's
keys/values is started before step i's computation, so it overlaps with it.
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

    def start(self, tensor: torch.Tensor):
        """(received buffer, pending requests): call `finish(requests)` before reading the buffer."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        operations = [
            dist.P2POp(dist.isend, tensor, self.next_rank, self.group),
            dist.P2POp(dist.irecv, received, self.previous_rank, self.group),
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
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.group, ctx.dropout, ctx.use_cudnn = scale, causal, group, dropout, use_cudnn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        neighbours = _RingNeighbours(ctx.group)
        dropout = None if ctx.dropout is None else ctx.dropout.replay()  # the forward's masks, in order
        n = q.size(-2) // 2
        key_values = torch.stack((k, v))
        dq = None  # fp32; step 0 covers every row and writes it
        grad_requests = None
        for step in range(neighbours.size):
            if step + 1 < neighbours.size:
                incoming, requests = neighbours.start(key_values)
            rows, columns, offset = _step_blocks(step, neighbours, ctx.causal, n)
            block_dq, block_dk, block_dv = block_attention_backward(
                dout[..., rows, :], q[..., rows, :], key_values[0][..., columns, :], key_values[1][..., columns, :],
                out[..., rows, :], lse[..., rows], ctx.scale, offset, dropout, ctx.use_cudnn,
            )
            if dq is None:
                dq = block_dq.float()
            else:
                dq[..., rows, :] += block_dq
            # The accumulator of this block's dK/dV arrives from the rank that held the block one step ago; at
            # step 0 (every column) it starts here.
            if grad_requests is None:
                key_value_grads = torch.empty((2,) + k.shape, dtype=torch.float32, device=k.device)
                key_value_grads[0].copy_(block_dk)
                key_value_grads[1].copy_(block_dv)
            else:
                neighbours.finish(grad_requests)
                key_value_grads = incoming_grads
                key_value_grads[0][..., columns, :] += block_dk
                key_value_grads[1][..., columns, :] += block_dv
            incoming_grads, grad_requests = neighbours.start(key_value_grads)
            if step + 1 < neighbours.size:
                neighbours.finish(requests)
                key_values = incoming
        neighbours.finish(grad_requests)  # after c hops each accumulator is back with its owner
        dk, dv = incoming_grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None
