"""Context-parallel attention against full attention on the whole sequence (plain torch, float64).

On 4 gloo ranks: CP=2 (two CP groups side by side) and CP=4, ring (p2p) and all-gather, causal and
unmasked, multi-head and grouped-query (4 query heads on 2 key/value heads). Each rank feeds its two
chunks (r and 2c-1-r, cut here by hand) of the same random Q, K, V and output gradient; its output and
its Q, K, V gradients must equal the matching rows of the reference's. Inputs are fp32 and the kernels
compute in fp32: tolerance 1e-5 (measured ~1e-6).

With attention dropout the reference needs the masks: a first call with V = the identity (value row j =
one-hot j) returns each query row's dropped-out probabilities over the whole sequence, from which the
test reads the keep mask; a second call with the same seed and the real V must then equal, forward and
backward, plain softmax(QK^T * scale + causal) * keep / (1 - p) V.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel import (
    context_parallel_attention,
    cp_comm_type_problems,
    get_batch_on_this_cp_rank,
    get_pos_emb_on_this_cp_rank,
)
from megatron.core.transformer.context_parallel import block_attention, ring_attention, tiled_block_attention
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.transformer.context_parallel.test_flash_block_attention import (
    _cpu_backward_kernel,
    _cpu_forward_kernel,
)

SEQ, BATCH, HEAD_DIM, HEADS, SCALE = 16, 2, 8, 4, 0.3
TOLERANCE = 1e-5


def _reference_attention(query, key, value, causal):
    """[s, b, np, d] x [s, b, ng, d] -> [s, b, np * d], float64 softmax(QK^T * scale + mask) V."""
    heads_per_group = query.size(2) // key.size(2)
    q = query.double().permute(1, 2, 0, 3)
    k = key.double().repeat_interleave(heads_per_group, dim=2).permute(1, 2, 0, 3)
    v = value.double().repeat_interleave(heads_per_group, dim=2).permute(1, 2, 0, 3)
    scores = q @ k.transpose(-1, -2) * SCALE  # [b, np, s, s]
    if causal:
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v  # [b, np, s, d]
    return context.permute(2, 0, 1, 3).reshape(SEQ, query.size(1), -1)


def _inputs(groups: int, head_dim: int = HEAD_DIM):
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(SEQ, BATCH, HEADS, head_dim, generator=generator)
    key = torch.randn(SEQ, BATCH, groups, head_dim, generator=generator)
    value = torch.randn(SEQ, BATCH, groups, head_dim, generator=generator)
    dout = torch.randn(SEQ, BATCH, HEADS * head_dim, generator=generator)
    return query, key, value, dout


def _rows_of_rank(cp_rank: int, cp_size: int) -> torch.Tensor:
    """Sequence positions of chunks r and 2c-1-r (Megatron's `get_batch_on_this_cp_rank`)."""
    n = SEQ // (2 * cp_size)
    return torch.cat([torch.arange(chunk * n, (chunk + 1) * n) for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def _worst_errors(cp_size: int) -> dict:
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    cp_rank = parallel_state.get_context_parallel_rank()
    rows = _rows_of_rank(cp_rank, cp_size)
    worst = {}
    for groups in (HEADS, 2):
        query, key, value, dout = _inputs(groups)
        for causal in (True, False):
            full = [tensor.double().requires_grad_() for tensor in (query, key, value)]
            reference = _reference_attention(*full, causal)
            expected = [reference] + list(torch.autograd.grad(reference, full, dout.double()))
            for comm_type in ("p2p", "all_gather"):
                local = [tensor[rows].clone().requires_grad_() for tensor in (query, key, value)]
                output = context_parallel_attention(*local, SCALE, causal, comm_type)
                actual = [output] + list(torch.autograd.grad(output, local, dout[rows]))
                worst[(groups, causal, comm_type)] = max(
                    (got.double() - want[rows]).abs().max().item() for got, want in zip(actual, expected)
                )
    parallel_state.destroy_model_parallel()
    return worst


DROPOUT = 0.3


def _dropout_errors(cp_size: int) -> dict:
    """Worst error against the reference with the read-out keep masks, and the fraction of entries dropped."""
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    group, cp_rank = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()
    rows = _rows_of_rank(cp_rank, cp_size)
    query, key, value, dout = _inputs(2, head_dim=SEQ)  # V may then be the identity
    identity = torch.eye(SEQ).view(SEQ, 1, 1, SEQ).expand(SEQ, BATCH, 2, SEQ)
    causal_visible = ~torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    worst = {}
    for comm_type in ("p2p", "all_gather"):
        seed = 1234
        readout = context_parallel_attention(
            query[rows], key[rows], identity[rows], SCALE, True, comm_type, dropout_p=DROPOUT, dropout_seed=seed
        ).view(len(rows), BATCH, HEADS, SEQ)
        gathered = [torch.empty_like(readout) for _ in range(cp_size)]
        dist.all_gather(gathered, readout, group=group)
        dropped = torch.empty(SEQ, BATCH, HEADS, SEQ)
        for rank, rows_of_rank in enumerate(gathered):
            dropped[_rows_of_rank(rank, cp_size)] = rows_of_rank
        keep = (dropped != 0).permute(1, 2, 0, 3).double()  # [b, np, s, s]

        full = [tensor.double().requires_grad_() for tensor in (query, key, value)]
        q, k, v = (t.permute(1, 2, 0, 3) for t in full)
        k, v = (t.repeat_interleave(HEADS // 2, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~causal_visible, float("-inf"))
        reference = (torch.softmax(scores, dim=-1) * keep / (1 - DROPOUT) @ v).permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
        expected = [reference] + list(torch.autograd.grad(reference, full, dout.double()))

        local = [tensor[rows].clone().requires_grad_() for tensor in (query, key, value)]
        output = context_parallel_attention(*local, SCALE, True, comm_type, dropout_p=DROPOUT, dropout_seed=seed)
        actual = [output] + list(torch.autograd.grad(output, local, dout[rows]))
        worst[comm_type] = max((got.double() - want[rows]).abs().max().item() for got, want in zip(actual, expected))
        worst[f"{comm_type} dropped"] = 1 - keep[..., causal_visible].mean().item()
    parallel_state.destroy_model_parallel()
    return worst


def _batch_split() -> dict:
    """This rank's tokens of 0..7 and rotary rows under CP=2 (ranks 0, 1 and 2, 3 form the CP groups)."""
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    tokens = torch.arange(8).expand(2, 8)
    mask = torch.arange(64).view(1, 1, 8, 8).expand(2, 1, 8, 8)
    batch = get_batch_on_this_cp_rank({"tokens": tokens.clone(), "attention_mask": mask.clone(), "labels": None})
    angles = get_pos_emb_on_this_cp_rank(torch.arange(8.0).view(8, 1, 1, 1), seq_dim=0)
    parallel_state.destroy_model_parallel()
    return dict(batch=batch, angles=angles.flatten().tolist())


def _ring_in_bf16(accumulator_dtype) -> list:
    """Output and Q, K, V gradients of the CP=2 ring on bf16 inputs through the fused-kernel path (the CPU flash
    kernel standing in for the CUDA one), causal, MHA and GQA, with the given accumulator_dtype."""
    patched = dict(_flash_kernel_takes=lambda q, k, v: True, _flash_forward_kernel=_cpu_forward_kernel,
                   _flash_backward_kernel=_cpu_backward_kernel)
    saved = {name: getattr(block_attention, name) for name in patched}
    saved_dtype = ring_attention.accumulator_dtype
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    rows = _rows_of_rank(parallel_state.get_context_parallel_rank(), 2)
    try:
        for name, value in patched.items():
            setattr(block_attention, name, value)
        ring_attention.accumulator_dtype = accumulator_dtype
        results = []
        for groups in (HEADS, 2):
            query, key, value, dout = (t[rows].bfloat16() for t in _inputs(groups))
            local = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
            output = context_parallel_attention(*local, SCALE, True, "p2p")
            results += [output, *torch.autograd.grad(output, local, dout)]
    finally:
        for name, value in saved.items():
            setattr(block_attention, name, value)
        ring_attention.accumulator_dtype = saved_dtype
        parallel_state.destroy_model_parallel()
    return results


def _bf16_accumulators() -> dict:
    ours = _ring_in_bf16(ring_attention.accumulator_dtype)
    fp32 = _ring_in_bf16(lambda ring_size, block_dtype: torch.float32)
    assert ours[1].dtype == torch.bfloat16
    return dict(equal=all(torch.equal(a, b) for a, b in zip(ours, fp32)),
                accumulator=str(ring_attention.accumulator_dtype(2, torch.bfloat16)))


def _all_checks(rank, world_size):
    return dict(cp2=_worst_errors(2), cp4=_worst_errors(4), split=_batch_split(),
                dropout2=_dropout_errors(2), dropout4=_dropout_errors(4), bf16=_bf16_accumulators())


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_checks, 4)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_attention_equals_full_attention(results, cp_size):
    """Forward and backward, both comm types, causal and unmasked, MHA and GQA."""
    for rank, per_rank in enumerate(results):
        bad = {case: error for case, error in per_rank[f"cp{cp_size}"].items() if error > TOLERANCE}
        assert not bad, f"CP={cp_size} rank {rank}: {bad}"
        assert len(per_rank[f"cp{cp_size}"]) == 8


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_attention_dropout_equals_masked_full_attention(results, cp_size):
    """Ring and all-gather with p = 0.3: the same function as full attention with the masks they drew."""
    for rank, per_rank in enumerate(results):
        worst = per_rank[f"dropout{cp_size}"]
        for comm_type in ("p2p", "all_gather"):
            assert worst[comm_type] < TOLERANCE, f"CP={cp_size} rank {rank} {comm_type}: {worst[comm_type]}"
            assert 0.2 < worst[f"{comm_type} dropped"] < 0.4, worst


def test_two_rank_ring_adds_16_bit_gradients_as_fp32_would(results):
    """At CP=2 the ring backward adds the fused kernels' bf16 gradients in bf16 (each element gets at most two
    shares, one rounding): output and gradients equal those of fp32 accumulators, bit for bit."""
    for per_rank in results:
        assert per_rank["bf16"] == dict(equal=True, accumulator="torch.bfloat16")


def test_batch_split_keeps_chunks_r_and_2c_minus_1_minus_r(results):
    """Megatron's load balancing: CP=2 over 4 chunks, rank 0 -> chunks 0 and 3, rank 1 -> chunks 1 and 2."""
    expected = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    for rank, per_rank in enumerate(results):
        positions = expected[rank % 2]
        batch = per_rank["split"]["batch"]
        assert batch["tokens"].tolist() == [positions, positions]
        assert batch["labels"] is None
        # The mask keeps this rank's query rows (dim 2) and every key column.
        assert batch["attention_mask"].shape == (2, 1, 4, 8)
        assert batch["attention_mask"][0, 0, :, 0].tolist() == [8 * row for row in positions]
        assert per_rank["split"]["angles"] == [float(p) for p in positions]


def test_block_attention_in_tiles_equals_sdpa(monkeypatch):
    """One block, split into query tiles of 5 rows, with causal offsets and GQA, against SDPA."""
    monkeypatch.setattr(tiled_block_attention, "TILE_ELEMENTS", 5 * 2 * 2 * 2 * 12)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 2, 12, 8, generator=generator, requires_grad=True)  # [b, g, r, s, d]
    k, v = (torch.randn(2, 2, 1, 12, 8, generator=generator, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 2, 2, 12, 8, generator=generator)
    for offset in (None, 0, 4):
        output = block_attention.BlockAttention.apply(q, k, v, SCALE, offset)
        mask = None if offset is None else ~torch.ones(12, 12, dtype=torch.bool).triu(1 + offset)
        reference = torch.nn.functional.scaled_dot_product_attention(
            q, k.expand_as(q), v.expand_as(q), attn_mask=mask, scale=SCALE
        )
        for got, want in zip(
            [output] + list(torch.autograd.grad(output, (q, k, v), dout)),
            [reference] + list(torch.autograd.grad(reference, (q, k, v), dout)),
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cp_comm_type_problems_name_the_valid_values():
    assert cp_comm_type_problems("p2p", 4) == []
    assert cp_comm_type_problems(["allgather", "p2p"], 2) == []
    assert cp_comm_type_problems(["p2p"] * 3, 2) == [
        "cp_comm_type lists 3 types; give one for all layers or one per layer (2)"
    ]
    assert cp_comm_type_problems("a2a", 2) == ["cp_comm_type 'a2a' is not supported yet; use p2p or all_gather"]
    assert "valid: p2p, all_gather, a2a, a2a+p2p" in cp_comm_type_problems("ring", 2)[0]
