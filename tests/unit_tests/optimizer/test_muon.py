"""Muon (--optimizer muon): the Newton-Schulz iteration against the polar factor and its one-step formula, the
update rule on hand-worked steps, which params Muon takes, and tensor parallelism: the update of a matrix split
over two ranks against the whole matrix on one."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, TensorParallelMuon, get_megatron_optimizer
from megatron.core.optimizer.muon import muon_scale_factor, newton_schulz
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed


def _matrix(rows, cols, seed):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_newton_schulz_converges_to_the_polar_factor():
    # deepseekv4 repeats its last (2, -1.5, 0.5), which converges to U V^T (x = U S V^T); fp32 iterations.
    for shape in ((8, 20), (20, 8)):
        x = _matrix(*shape, seed=0)
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        torch.testing.assert_close(newton_schulz(x, 14, "deepseekv4", bf16=False), u @ vh, atol=1e-5, rtol=0)


def test_one_step_is_the_formula():
    x = _matrix(6, 4, seed=1)
    a, b, c = 3.4445, -4.7750, 2.0315
    X = (x / x.norm()).T  # wide
    A = X @ X.T
    expected = (a * X + (b * A + c * A @ A) @ X).T
    torch.testing.assert_close(newton_schulz(x, 1, "simple", bf16=False), expected)
    # medium precision: the same iteration in bf16, rounded once after the normalisation.
    Xb = X.to(torch.bfloat16)
    Ab = Xb @ Xb.T
    expected_bf16 = torch.addmm(Xb, torch.addmm(Ab, Ab, Ab, alpha=c, beta=b), Xb, beta=a).float().T
    assert torch.equal(newton_schulz(x, 1, "simple", bf16=True), expected_bf16)


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_hand_worked_steps(nesterov):
    lr, wd, momentum = 0.1, 0.5, 0.9
    w0, g1, g2 = _matrix(4, 6, 2), _matrix(4, 6, 3), _matrix(4, 6, 4)
    param = torch.nn.Parameter(w0.clone())
    muon = TensorParallelMuon([param], lr=lr, momentum=momentum, weight_decay=wd, nesterov=nesterov,
                              fp32_matmul_prec="high", scale_mode="spectral", extra_scale_factor=0.2)
    weight, buffer = w0.clone(), torch.zeros(4, 6)
    for grad in (g1, g2):
        param.grad = grad.clone()
        muon.step()
        weight = weight - lr * wd * weight
        buffer = momentum * buffer + (1 - momentum) * grad
        update = (1 - momentum) * grad + momentum * buffer if nesterov else buffer
        weight = weight - lr * 0.2 * 6 ** 0.5 * newton_schulz(update, 5, "quintic", bf16=False)
    torch.testing.assert_close(param.detach(), weight)
    torch.testing.assert_close(muon.state[param]["momentum_buffer"], buffer)


def test_scale_modes():
    assert muon_scale_factor(4, 16, "spectral") == 4.0
    assert muon_scale_factor(16, 4, "unit_rms_norm") == 2.0
    assert muon_scale_factor(4, 16, "shape_scaling") == 1.0 and muon_scale_factor(16, 4, "shape_scaling") == 2.0


def test_matrices_to_muon_the_rest_to_adam():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8,
                     share_embeddings_and_output_weights=False)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1), [model])
    assert isinstance(optimizer, ChainedOptimizer)
    names = {id(param): name for name, param in model.named_parameters()}
    muon, adam = ([names[id(param)] for group in sub.param_groups for param in group["params"]]
                  for sub in optimizer.chained_optimizers)
    # Every matrix but the word embedding and the output layer (the position embedding is one, as Megatron-LM's).
    assert sorted(muon) == ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                            "decoder.layers.0.self_attention.linear_proj.weight",
                            "decoder.layers.0.self_attention.linear_qkv.weight", "embedding.position_embeddings.weight"]
    # The embedding, the output layer, 3 norms' weights and biases, 4 linear biases.
    assert sorted(adam) == sorted(set(names.values()) - set(muon)) and len(adam) == 12
    assert "embedding.word_embeddings.weight" in adam and "output_layer.weight" in adam
    # 4 heads in 2 groups of hn 4: per group 2 query heads, a key and a value head.
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.qkv_split_shapes == [8, 4, 4]


def _split_qkv_by_hand(update, shapes, bf16):
    groups = update.view(update.size(0) // sum(shapes), sum(shapes), -1)
    parts = [newton_schulz(part.reshape(-1, update.size(1)), 5, "quintic", bf16).view(groups.size(0), -1,
                                                                                        update.size(1))
             for part in groups.split(shapes, dim=1)]
    scales = [muon_scale_factor(groups.size(0) * shape, update.size(1), "spectral") for shape in shapes]
    return torch.cat([part * scale for part, scale in zip(parts, scales)], dim=1).view_as(update)


def test_fused_qkv_orthogonalized_part_by_part():
    update, shapes = _matrix(32, 16, 5), [8, 4, 4]
    param = torch.nn.Parameter(torch.zeros(32, 16))
    param.qkv_split_shapes = shapes
    muon = TensorParallelMuon([param], lr=0.1, momentum=0.9, weight_decay=0.0)
    assert torch.equal(muon.orthogonalize(param, update), _split_qkv_by_hand(update, shapes, bf16=True))
    whole = TensorParallelMuon([param], lr=0.1, momentum=0.9, weight_decay=0.0, split_qkv=False)
    assert torch.equal(whole.orthogonalize(param, update), newton_schulz(update, 5) * 32 ** 0.5)


_TP_CASES = (((24, 10), 0, None), ((10, 24), 1, None), ((64, 16), 0, [8, 4, 4]))  # (shape, split dim, QKV)


def _tensor_parallel_updates(rank, world_size):
    """{tp mode: this rank's updates of a column-parallel (dim 0), a row-parallel (dim 1) and a fused QKV matrix
    (dim 0, two query groups per rank), each the rank's block of the same whole update}."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {}
    for tp_mode in ("duplicated", "distributed"):
        muon = TensorParallelMuon([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9, weight_decay=0.0,
                                  tp_mode=tp_mode)
        results[tp_mode] = []
        for seed, ((rows, cols), dim, shapes) in enumerate(_TP_CASES):
            param = torch.nn.Parameter(_matrix(rows, cols, seed).chunk(world_size, dim=dim)[rank].clone())
            param.tensor_model_parallel, param.partition_dim = True, dim
            if shapes:
                param.qkv_split_shapes = shapes
            results[tp_mode].append(muon.orthogonalize(param, param.detach()))
    parallel_state.destroy_model_parallel()
    return results


def test_two_tensor_parallel_ranks_update_as_one():
    ranks = run_distributed(_tensor_parallel_updates, 2)
    muon = TensorParallelMuon([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9, weight_decay=0.0)
    for seed, ((rows, cols), dim, shapes) in enumerate(_TP_CASES):
        param = torch.nn.Parameter(_matrix(rows, cols, seed))
        if shapes:
            param.qkv_split_shapes = shapes
        expected = muon.orthogonalize(param, param.detach())
        # duplicated: the very matrix orthogonalized on each rank, bit-identical.
        assert torch.equal(torch.cat([ranks[0]["duplicated"][seed], ranks[1]["duplicated"][seed]], dim=dim), expected)
        # distributed: the Gram matrices summed over the ranks in bf16, other rounding.
        distributed = torch.cat([ranks[0]["distributed"][seed], ranks[1]["distributed"][seed]], dim=dim)
        torch.testing.assert_close(distributed, expected, atol=0.05 * expected.abs().max().item(), rtol=0)
