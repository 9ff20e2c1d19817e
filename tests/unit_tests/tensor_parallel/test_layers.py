"""Column/Row-parallel linears and the vocab-parallel embedding against plain nn.Linear / nn.Embedding."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer.init_methods import init_method_normal
from tests.unit_tests.dist_utils import run_distributed

INIT = init_method_normal(0.02)


def _close(a, b) -> float:
    """Max error relative to the reference's scale (the squared-sum loss makes grads O(100))."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def test_tp1_layers_are_linear_and_embedding():
    config = ModelParallelConfig(use_cpu_initialization=True)
    torch.manual_seed(0)
    column = ColumnParallelLinear(8, 6, config=config, init_method=INIT, bias=True)
    row = RowParallelLinear(6, 5, config=config, init_method=INIT, bias=True, skip_bias_add=True)
    embedding = VocabParallelEmbedding(10, 8, init_method=INIT, config=config)
    torch.manual_seed(0)
    expected_column_weight = torch.empty(6, 8).normal_(0, 0.02)
    torch.testing.assert_close(column.weight.data, expected_column_weight)  # one normal draw, like nn.init

    x = torch.randn(3, 2, 8)
    out, bias = column(x)
    assert bias is None
    torch.testing.assert_close(out, torch.nn.functional.linear(x, column.weight, column.bias))
    out, bias = row(out)
    assert bias is row.bias
    torch.testing.assert_close(out, torch.nn.functional.linear(column(x)[0], row.weight))
    ids = torch.randint(0, 10, (2, 3))
    torch.testing.assert_close(embedding(ids), embedding.weight[ids])


def _parallel_linears_and_embedding(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {}
    generator = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(8, 6, generator=generator), torch.randn(8, generator=generator)
    w2, b2 = torch.randn(5, 8, generator=generator), torch.randn(5, generator=generator)
    x = torch.randn(4, 2, 6, generator=generator)  # [s, b, h]

    # Reference: two plain linears.
    x_ref = x.clone().requires_grad_(True)
    ref_w1, ref_b1, ref_w2, ref_b2 = (t.clone().requires_grad_(True) for t in (w1, b1, w2, b2))
    reference = torch.nn.functional.linear(torch.nn.functional.linear(x_ref, ref_w1, ref_b1), ref_w2, ref_b2)
    reference.square().sum().backward()

    for sequence_parallel in (False, True):
        config = ModelParallelConfig(
            tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel, perform_initialization=False
        )
        column = ColumnParallelLinear(6, 8, config=config, init_method=INIT, bias=True, gather_output=False)
        row = RowParallelLinear(8, 5, config=config, init_method=INIT, bias=True, input_is_parallel=True)
        with torch.no_grad():  # rank r: rows [4r, 4r+4) of w1/b1, columns of w2
            column.weight.copy_(w1.chunk(world_size, 0)[rank])
            column.bias.copy_(b1.chunk(world_size, 0)[rank])
            row.weight.copy_(w2.chunk(world_size, 1)[rank])
            row.bias.copy_(b2)
        x_local = (x.chunk(world_size, 0)[rank] if sequence_parallel else x).clone().requires_grad_(True)
        hidden, _ = column(x_local)
        assert hidden.shape == (4, 2, 4)
        out, _ = row(hidden)
        out.square().sum().backward()
        expected_out = reference.chunk(world_size, 0)[rank] if sequence_parallel else reference
        expected_x_grad = x_ref.grad.chunk(world_size, 0)[rank] if sequence_parallel else x_ref.grad
        row_bias_grad = row.bias.grad.clone()
        if sequence_parallel:
            dist.all_reduce(row_bias_grad, group=parallel_state.get_tensor_model_parallel_group())
        results[f"sp={sequence_parallel}"] = max(
            _close(out, expected_out),
            _close(x_local.grad, expected_x_grad),
            _close(column.weight.grad, ref_w1.grad.chunk(world_size, 0)[rank]),
            _close(column.bias.grad, ref_b1.grad.chunk(world_size, 0)[rank]),
            _close(row.weight.grad, ref_w2.grad.chunk(world_size, 1)[rank]),
            _close(row_bias_grad, ref_b2.grad),
        )

    # Uneven output split (7 = 4 + 3) gathered back; row layer scattering an unsplit input.
    config = ModelParallelConfig(tensor_model_parallel_size=world_size, perform_initialization=False)
    w3 = torch.randn(7, 6, generator=generator)
    gathered = ColumnParallelLinear(6, 7, config=config, init_method=INIT, bias=False, gather_output=True)
    scattering = RowParallelLinear(7, 3, config=config, init_method=INIT, bias=False, input_is_parallel=False)
    w4 = torch.randn(3, 7, generator=generator)
    with torch.no_grad():
        gathered.weight.copy_(w3[[range(0, 4), range(4, 7)][rank]])
        scattering.weight.copy_(w4[:, [range(0, 4), range(4, 7)][rank]])
    full, _ = gathered(x)
    out, _ = scattering(full)
    results["uneven"] = max(_close(full, x @ w3.t()), _close(out, x @ w3.t() @ w4.t()))

    # Vocabulary of 11 split 6 + 5; ids from both halves.
    table = torch.randn(11, 6, generator=generator)
    embedding = VocabParallelEmbedding(11, 6, init_method=INIT, config=config)
    with torch.no_grad():
        embedding.weight.copy_(table[[range(0, 6), range(6, 11)][rank]])
    ids = torch.randint(0, 11, (2, 5), generator=generator)
    looked_up = embedding(ids)
    looked_up.sum().backward()
    expected_grad = torch.zeros(11, 6).index_add_(0, ids.flatten(), torch.ones(10, 6))
    results["embedding"] = max(
        _close(looked_up, table[ids]), _close(embedding.weight.grad, expected_grad[[range(0, 6), range(6, 11)][rank]])
    )

    # Without use_cpu_initialization each rank draws its shard from its own model-parallel stream.
    model_parallel_cuda_manual_seed(5)
    torch.manual_seed(5)
    config = ModelParallelConfig(tensor_model_parallel_size=world_size)
    shard = ColumnParallelLinear(6, 8, config=config, init_method=INIT, bias=False).weight.detach()
    shards = [torch.empty_like(shard) for _ in range(world_size)]
    dist.all_gather(shards, shard)
    results["distinct_shards"] = not torch.equal(shards[0], shards[1])
    return results


def test_tp2_layers_match_plain_linear_and_embedding():
    for results in run_distributed(_parallel_linears_and_embedding, 2):
        assert results.pop("distinct_shards")
        assert all(error < 1e-5 for error in results.values()), results
