"""The TP linears' GEMM + collective Functions (linear_with_comm.py, comm_overlap.py) against plain linears.

On 4 gloo ranks, at TP=4 (partial sums exchanged in 3 steps) and TP=2 (two groups, [0, 1] and [2, 3], so the
peers are group ranks, not global ones): a column-parallel linear followed by a row-parallel one, both with
biases and sequence parallelism, fp32. Each of three implementations is checked against one process's
plain `F.linear` chain over the whole sequence (outputs, input grads, weight and bias grads):

    plain              all-gather / reduce-scatter next to the GEMMs, backward collectives overlapped
    chunked            --tp-comm-overlap on CPU: async all-gather + own rows first; p2p partial sums
    symmetric_memory   --tp-comm-overlap's CUDA path, PyTorch's symmetric-memory ops replaced by reference
                       implementations of the same ops (the glue: shapes, transposes, return_A, which rank's
                       partial products are summed), since the kernels need GPUs
                       (tools/bench/tp_overlap_check.py runs them)

Tolerances, relative to each tensor's largest entry (or absolute below 1): 1e-5 against the reference
(measured <= 1.5e-7); 1e-6 between overlapped and plain (measured: 0 at TP=2, where the sums are the same;
<= 1e-7 at TP=4, where the partial products are added in another order). Also: weight gradients accumulated
into main_grad (gradient-accumulation fusion) equal the returned ones (within 1e-5, measured 5e-7), the
implementation choice on CPU, and gloo groups made by their own ranks only (host_group.py).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _symmetric_memory

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, comm_overlap
from megatron.core.tensor_parallel.host_group import all_gather_ints_on_host
from megatron.core.tensor_parallel.linear_with_comm import column_parallel_linear
from megatron.core.transformer.init_methods import init_method_normal
from tests.unit_tests.dist_utils import run_distributed

SEQ, BATCH, HIDDEN, FFN, OUT = 8, 2, 6, 8, 5
TOLERANCE, OVERLAP_TOLERANCE = 1e-5, 1e-6


def _scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in
            ((SEQ, BATCH, HIDDEN), (FFN, HIDDEN), (FFN,), (OUT, FFN), (OUT,), (SEQ, BATCH, OUT))]


def _reference():
    """Outputs and grads of the plain chain on one process: y = (x W1^T + b1) W2^T + b2, loss = <y, g>."""
    x, w1, b1, w2, b2, g = _tensors()
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    y = F.linear(F.linear(leaves[0], leaves[1], leaves[2]), leaves[3], leaves[4])
    (y * g).sum().backward()
    return y.detach(), [leaf.grad for leaf in leaves]


def _sharded_run(tp: int, rank: int, overlap: bool):
    """(output shard, [x grad shard, W1 grad shard, b1 grad shard, W2 grad shard, b2 grad]) of the layers."""
    x, w1, b1, w2, b2, g = _tensors()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True, tp_comm_overlap=overlap,
                                 perform_initialization=False)
    column = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init_method_normal(0.02), bias=True)
    row = RowParallelLinear(FFN, OUT, config=config, init_method=init_method_normal(0.02), bias=True)
    with torch.no_grad():
        column.weight.copy_(w1.chunk(tp, 0)[rank])
        column.bias.copy_(b1.chunk(tp, 0)[rank])
        row.weight.copy_(w2.chunk(tp, 1)[rank])
        row.bias.copy_(b2)
    x_shard = x.chunk(tp, 0)[rank].clone().requires_grad_(True)
    output, _ = row(column(x_shard)[0])
    (output * g.chunk(tp, 0)[rank]).sum().backward()
    # The row-parallel bias saw this rank's tokens only: finalize_model_grads sums it over TP.
    b2_grad = row.bias.grad.clone()
    dist.all_reduce(b2_grad, group=parallel_state.get_tensor_model_parallel_group())
    return output.detach(), [x_shard.grad, column.weight.grad, column.bias.grad, row.weight.grad, b2_grad]


def _with_reference_fused_ops(group):
    """Makes --tp-comm-overlap take its symmetric-memory path on `group`, through reference implementations of
    PyTorch's symmetric-memory ops: its all-gather + GEMM fallback, and the exchange of the matmul + reduce-scatter
    pipeline as every block produced, then an all-to-all."""

    def produce_and_exchange(chunk_producer, output, group_name):
        assert group_name == group.group_name
        produced = torch.empty_like(output)
        for peer, block in enumerate(produced.chunk(dist.get_world_size(group))):
            chunk_producer(peer, block)
        dist.all_to_all_single(output, produced, group=group)

    comm_overlap._IMPLEMENTATIONS[group] = comm_overlap.SYMMETRIC_MEMORY
    comm_overlap.symmetric_memory_ops = lambda: (
        _symmetric_memory._fused_all_gather_matmul_fallback, produce_and_exchange
    )


def _layouts() -> dict:
    expected_output, expected_grads = _reference()
    results = {}
    for tp in (4, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()

        def shard(tensor, dim=0):
            return tensor.chunk(tp, dim)[tp_rank]

        expected = [shard(expected_grads[0]), shard(expected_grads[1]), shard(expected_grads[2]),
                    shard(expected_grads[3], 1), expected_grads[4]]
        runs = {"plain": _sharded_run(tp, tp_rank, overlap=False), "chunked": _sharded_run(tp, tp_rank, overlap=True)}
        assert comm_overlap.implementation(group, torch.device("cpu")) == comm_overlap.CHUNKED
        _with_reference_fused_ops(group)
        runs["symmetric_memory"] = _sharded_run(tp, tp_rank, overlap=True)
        for name, (output, grads) in runs.items():
            errors = [_scaled_error(output, shard(expected_output))]
            errors += [_scaled_error(grad, want) for grad, want in zip(grads, expected)]
            results[f"TP={tp} {name}"] = max(errors)
            if name != "plain":
                plain_output, plain_grads = runs["plain"]
                results[f"TP={tp} {name} vs plain"] = max(
                    _scaled_error(a, b) for a, b in zip([output, *grads], [plain_output, *plain_grads])
                )
        parallel_state.destroy_model_parallel()
    return results


def _accumulated_weight_gradient(overlap: bool) -> float:
    """|main_grad - the returned weight gradient| when column_parallel_linear accumulates into main_grad."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group, rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
    x, w1, b1, *_ = _tensors()
    grads = []
    for accumulate in (False, True):
        weight = w1.chunk(2, 0)[rank].clone().requires_grad_(True)
        weight.main_grad = torch.full_like(weight, 0.5)
        x_shard = x.chunk(2, 0)[rank].clone().requires_grad_(True)
        column_parallel_linear(x_shard, weight, None, group, rank, 2, True, overlap, accumulate).sum().backward()
        grads.append(weight.main_grad - 0.5 if accumulate else weight.grad)
        assert getattr(weight, "grad_added_to_main_grad", False) == accumulate
    parallel_state.destroy_model_parallel()
    return (grads[0] - grads[1]).abs().max().item()


def _implementation_choice() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group, outcome = parallel_state.get_tensor_model_parallel_group(), {}
    for requested in ("symmetric_memory", "infiniband"):
        os.environ[comm_overlap.IMPLEMENTATION_VARIABLE] = requested
        try:
            comm_overlap._choose(group, torch.device("cpu"))
        except (RuntimeError, ValueError) as error:
            outcome[requested] = f"{type(error).__name__}: {error}"
    os.environ[comm_overlap.IMPLEMENTATION_VARIABLE] = "chunked"
    outcome["chunked"] = comm_overlap._choose(group, torch.device("cpu"))
    del os.environ[comm_overlap.IMPLEMENTATION_VARIABLE]
    parallel_state.destroy_model_parallel()
    return outcome


def _gloo_groups_of_their_own_ranks(rank: int) -> list[int]:
    """Ranks 0-1 and 2-3 each make a gloo group among themselves, the second pair a second later."""
    if rank >= 2:
        time.sleep(1.0)
    pair = [0, 1] if rank < 2 else [2, 3]
    group = parallel_state.gloo_twin(pair)
    assert parallel_state.gloo_twin(pair) is group  # made once
    values = all_gather_ints_on_host(10 * rank, group)
    parallel_state.destroy_model_parallel()
    assert not parallel_state._GLOO_TWINS  # freed with the other groups
    return values


def _all_checks(rank, world_size):
    return {
        "layouts": _layouts(),
        "accumulate": {overlap: _accumulated_weight_gradient(overlap) for overlap in (False, True)},
        "choice": _implementation_choice(),
        "gloo": _gloo_groups_of_their_own_ranks(rank),
    }


def test_parallel_linears_with_and_without_overlap():
    for rank, results in enumerate(run_distributed(_all_checks, 4)):
        layouts = results["layouts"]
        for name, error in layouts.items():
            assert error <= (OVERLAP_TOLERANCE if name.endswith("vs plain") else TOLERANCE), (rank, name, layouts)
        assert len(layouts) == 10
        assert all(error < TOLERANCE for error in results["accumulate"].values()), results["accumulate"]
        choice = results["choice"]
        assert choice["chunked"] == "chunked"
        assert choice["symmetric_memory"].startswith("RuntimeError: MEGATRON_TP_COMM_OVERLAP_IMPL=symmetric_memory")
        assert "use symmetric_memory or chunked" in choice["infiniband"]
        assert results["gloo"] == ([0, 10] if rank < 2 else [20, 30])
