"""The sequence-parallel collectives of the TP linears, fused with their GEMMs (`--tp-comm-overlap`).

With p TP ranks, activations sequence-first and rows = sequence x batch, a linear `y = x A^T` (A [n, k],
the nn.Linear layout) meets a collective of the sequence in two patterns:

    all_gather_matmul       Y = AG_s(X_r) A^T          X_r [s/p, b, k] -> Y [s, b, n]
    matmul_reduce_scatter   Y_r = RS_s(X A^T)          X [s, b, k]     -> Y_r [s/p, b, n]

(forward of ColumnParallelLinear / RowParallelLinear under sequence parallelism; their backward has the
same two patterns, see linear_with_comm.py). Each has two implementations:

* symmetric memory (CUDA, an NCCL group whose ranks share one host with peer access): PyTorch's
  `torch.ops.symm_mem.fused_all_gather_matmul` (torchtitan's async TP), and for matmul_reduce_scatter the
  pipeline inside PyTorch's `fused_matmul_reduce_scatter` followed by a cheaper sum of the partials.
  The shards move between peer buffers by copy engine while the GEMMs of the shards already there run,
  so communication takes no SMs from the GEMMs. They are called so as to use barriers and peer copies
  only, never NVLS multicast (which hosts run with TORCH_SYMM_MEM_DISABLE_MULTICAST=1 must not touch).
* chunked (any backend, and what runs on a CPU with gloo):
    all_gather_matmul: the all-gather is started asynchronously and this rank's own rows multiplied
    meanwhile; the other ranks' rows follow when it has arrived.
    matmul_reduce_scatter: in steps k = 1 .. p-1, rank r multiplies the rows of rank (r + k) % p and sends
    that partial product while receiving rank (r - k) % p's partial product of its own rows, the next
    GEMM running during the transfer; its own rows come last, then the sum.

Both are exact rearrangements of all-gather + GEMM and GEMM + reduce-scatter: the same products, and for
p = 2 the same sums; for p > 2 the partial products are added in another order than NCCL's ring.

Symmetric memory is chosen for a group when every rank can use it; MEGATRON_TP_COMM_OVERLAP_IMPL=chunked
(or =symmetric_memory, to fail instead of falling back) overrides the choice.
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.host_group import host_group
from megatron.core.tensor_parallel.mappings import all_gather_single, check_sequence_split, reduce_scatter_single

IMPLEMENTATION_VARIABLE = "MEGATRON_TP_COMM_OVERLAP_IMPL"
SYMMETRIC_MEMORY, CHUNKED = "symmetric_memory", "chunked"
_IMPLEMENTATIONS: dict = {}


class Pending:
    """A result whose communication may still be running: `wait()` makes the current stream wait for it
    (never the host, with NCCL) and returns the tensor."""

    def __init__(self, result: torch.Tensor, works=(), addends=()):
        self._result, self._works, self._addends = result, works, addends

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        for addend in self._addends:
            self._result.add_(addend)
        self._works, self._addends = (), ()
        return self._result


def start_all_gather(shard: torch.Tensor, group, world_size: int) -> Pending:
    """AG_s(shard): [s/p, ...] -> [s, ...], started asynchronously."""
    gathered = shard.new_empty((world_size * shard.size(0),) + shard.shape[1:])
    return Pending(gathered, [all_gather_single(gathered, shard.contiguous(), group=group, async_op=True)])


def start_reduce_scatter(full: torch.Tensor, group, world_size: int) -> Pending:
    """RS_s(full): [s, ...] -> [s/p, ...] summed over the ranks, started asynchronously."""
    check_sequence_split(full, world_size)
    output = full.new_empty((full.size(0) // world_size,) + full.shape[1:])
    return Pending(output, [reduce_scatter_single(output, full.contiguous(), group=group, async_op=True)])


def start_all_reduce(tensor: torch.Tensor, group) -> Pending:
    """The sum of `tensor` over the ranks, in place, started asynchronously."""
    tensor = tensor.contiguous()
    return Pending(tensor, [dist.all_reduce(tensor, group=group, async_op=True)])


def rows(tensor: torch.Tensor) -> torch.Tensor:
    """[s, b, ..., k] -> [s * b * ..., k] (a view of a contiguous tensor)."""
    return tensor.reshape(-1, tensor.size(-1))


def _gemm(x2d: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d @ weight^T (+ bias), into `out` (rows of a larger result) when given."""
    if bias is None:
        return torch.mm(x2d, weight.t(), out=out)
    return torch.addmm(bias, x2d, weight.t(), out=out)


def all_gather_matmul(shard, weight, bias, group, rank, world_size, keep_gathered: bool):
    """(AG_s(shard) if keep_gathered else None, AG_s(shard) @ weight^T + bias): [s/p, b, k] -> [s, b, n]."""
    shard = shard.contiguous()
    if implementation(group, shard.device) == SYMMETRIC_MEMORY:
        fused_all_gather_matmul, _ = symmetric_memory_ops()
        # return_A=True also when the gathered input is not needed: without it, PyTorch may pick its multimem
        # (NVLS multicast) kernel for small inputs, which some hosts must not use.
        gathered, (output,) = fused_all_gather_matmul(shard, [weight.t()], 0, group.group_name, return_A=True)
        return (gathered if keep_gathered else None), output if bias is None else output.add_(bias)
    pending = start_all_gather(shard, group, world_size)
    output = shard.new_empty((world_size * shard.size(0),) + shard.shape[1:-1] + (weight.size(0),))
    output_rows, rows_per_rank = rows(output), rows(shard).size(0)
    _gemm(rows(shard), weight, bias, out=output_rows[rank * rows_per_rank : (rank + 1) * rows_per_rank])
    gathered = pending.wait()
    gathered_rows = rows(gathered)
    # The other ranks' rows: those before this rank's and those after, two contiguous blocks.
    for start, end in ((0, rank * rows_per_rank), ((rank + 1) * rows_per_rank, world_size * rows_per_rank)):
        if end > start:
            _gemm(gathered_rows[start:end], weight, bias, out=output_rows[start:end])
    return (gathered if keep_gathered else None), output


def matmul_reduce_scatter(input_, weight, group, rank, world_size) -> Pending:
    """RS_s(input @ weight^T): [s, b, k] -> [s/p, b, n] summed over the ranks (no bias: it is added once,
    after the sum, by the caller). The last transfers may still run when this returns."""
    input_ = input_.contiguous()
    check_sequence_split(input_, world_size)
    output_shape = (input_.size(0) // world_size,) + input_.shape[1:-1] + (weight.size(0),)
    input_rows = rows(input_)
    rows_per_rank = input_rows.size(0) // world_size
    if implementation(group, input_.device) == SYMMETRIC_MEMORY:
        return Pending(_symmetric_matmul_reduce_scatter(input_rows, weight, group, world_size).view(output_shape))
    works, received = [], []
    for step in range(1, world_size):
        destination, source = (rank + step) % world_size, (rank - step) % world_size
        partial = _gemm(input_rows[destination * rows_per_rank : (destination + 1) * rows_per_rank], weight, None)
        incoming = partial.new_empty(output_shape)
        works += dist.batch_isend_irecv([
            dist.P2POp(dist.isend, partial, group=group, group_peer=destination),
            dist.P2POp(dist.irecv, incoming, group=group, group_peer=source),
        ])
        received.append(incoming)
    own = _gemm(input_rows[rank * rows_per_rank : (rank + 1) * rows_per_rank], weight, None)
    return Pending(own.view(output_shape), works, received)


def implementation(group, device: torch.device) -> str:
    """SYMMETRIC_MEMORY or CHUNKED for `group` (decided once per group, the same on all its ranks)."""
    if group not in _IMPLEMENTATIONS:
        _IMPLEMENTATIONS[group] = _choose(group, device)
    return _IMPLEMENTATIONS[group]


def _choose(group, device: torch.device) -> str:
    """Symmetric memory when asked for or possible on every rank of `group`: CUDA tensors, an NCCL group,
    PyTorch's symmetric-memory ops, all ranks on this host with peer access to one another, and a workspace
    that every rank could allocate; else CHUNKED. Collective over the group (on the host)."""
    requested = os.environ.get(IMPLEMENTATION_VARIABLE, "")
    if requested not in ("", SYMMETRIC_MEMORY, CHUNKED):
        raise ValueError(f"{IMPLEMENTATION_VARIABLE}={requested!r}: use {SYMMETRIC_MEMORY} or {CHUNKED}")
    if requested == CHUNKED:
        return CHUNKED
    eligible = device.type == "cuda" and dist.get_backend(group) == dist.Backend.NCCL and _has_symmetric_memory_ops()
    peers = [None] * dist.get_world_size(group)
    dist.all_gather_object(peers, (socket.gethostname(), device.index, eligible), group=host_group(group))
    eligible = all(host == peers[0][0] and ok for host, _, ok in peers) and all(
        index == device.index or torch.cuda.can_device_access_peer(device, index) for _, index, _ in peers
    )
    # Each rank checks its own peer access, so they agree before the workspace (a collective) is tried.
    eligible = _all_ranks(eligible, group) and _all_ranks(_workspace_allocates(group), group)
    if requested == SYMMETRIC_MEMORY and not eligible:
        raise RuntimeError(
            f"{IMPLEMENTATION_VARIABLE}={SYMMETRIC_MEMORY}, but PyTorch's symmetric memory cannot serve the "
            f"tensor-parallel group (ranks {dist.get_process_group_ranks(group)}): it needs CUDA, NCCL, ranks on "
            "one host with peer access, and torch.distributed._symmetric_memory"
        )
    return SYMMETRIC_MEMORY if eligible else CHUNKED


def _symmetric_matmul_reduce_scatter(input_rows, weight, group, world_size: int) -> torch.Tensor:
    """This rank's rows of RS(input_rows @ weight^T): [s * b, k] -> [s/p * b, n], through symmetric memory.

    PyTorch's fused_matmul_reduce_scatter runs the pipeline of `symmetric_memory_ops` (each rank's partial
    products of the other ranks' rows, pulled by their copy engines while the next GEMM runs), then sums the
    p partial products of each rank's rows with torch.sum(dim=0): a reduction kernel that read [2, 4096 x 2048]
    bf16 at 1.3 TB/s on an H200 (36 us; 97 of them, 3.5 ms, in a GPT 1.3B step at TP=2 + SP, 4 a layer). Here
    the same pipeline is followed, for p = 2, by an elementwise addition of the two, which streams the same
    bytes in 12 us and gives the same bits (both add in fp32 and round once)."""
    _, produce_and_exchange = symmetric_memory_ops()
    rows_per_rank = input_rows.size(0) // world_size
    blocks = input_rows.split(rows_per_rank)
    partials = input_rows.new_empty((world_size, rows_per_rank, weight.size(0)))  # [r]: rank r's, of my rows
    produce_and_exchange(
        lambda peer, out: torch.mm(blocks[peer], weight.t(), out=out), partials.view(-1, weight.size(0)),
        group.group_name,
    )
    return torch.add(partials[0], partials[1]) if world_size == 2 else partials.sum(dim=0)


def symmetric_memory_ops():
    """(fused_all_gather_matmul, produce_and_exchange) of PyTorch's symmetric memory (alpha API):
    torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], gather_dim, group_name, return_A=...), and the
    pipeline of its fused_matmul_reduce_scatter, `_pipelined_produce_and_all2all(chunk_producer, output,
    group_name)`: `chunk_producer(r, out)` writes this rank's block for rank r into `out`, and block r of
    `output` (split along dim 0) receives rank r's block for this rank."""
    from torch.distributed._symmetric_memory import _pipelined_produce_and_all2all  # registers torch.ops.symm_mem

    return torch.ops.symm_mem.fused_all_gather_matmul, _pipelined_produce_and_all2all


def _has_symmetric_memory_ops() -> bool:
    try:
        symmetric_memory_ops()
    except (ImportError, AttributeError):
        return False
    return True


def _workspace_allocates(group) -> bool:
    """Whether this rank could set up the group's symmetric-memory workspace (it fails where the
    container forbids the system calls that exchange the peer buffers, e.g. pidfd_getfd)."""
    from torch.distributed import _symmetric_memory as symmetric_memory

    try:
        if not symmetric_memory.is_symm_mem_enabled_for_group(group.group_name):
            with warnings.catch_warnings():  # deprecated (no longer needed) in recent PyTorch
                warnings.simplefilter("ignore", FutureWarning)
                symmetric_memory.enable_symm_mem_for_group(group.group_name)
        symmetric_memory.get_symm_mem_workspace(group.group_name, min_size=1 << 20)
    except RuntimeError as error:
        warnings.warn(f"symmetric memory is not usable, --tp-comm-overlap falls back to chunked collectives: {error}")
        return False
    return True


def _all_ranks(flag: bool, group) -> bool:
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, flag, group=host_group(group))
    return all(flags)
