"""Activation recompute (full uniform/block, selective core_attn/mlp) gives the same loss and gradients
as no recompute, with dropout on (so the RNG replay is exercised)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ = 64, 12


def _loss_and_grads(attention_backend="auto", **recompute):
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.2, attention_dropout=0.2, attention_backend=attention_backend,
        use_cpu_initialization=True, **recompute,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    model_parallel_cuda_manual_seed(42)
    loss = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _without_recompute(attention_backend):
    return _loss_and_grads(attention_backend)


@pytest.mark.parametrize(
    "attention_backend, recompute",
    [
        ("auto", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
        ("auto", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)),
        ("auto", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
        ("auto", dict(recompute_granularity="selective")),
        ("unfused", dict(recompute_granularity="selective")),
        ("auto", dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])),
    ],
)
def test_recompute_matches_no_recompute(attention_backend, recompute):
    expected_loss, expected_grads = _without_recompute(attention_backend)
    loss, grads = _loss_and_grads(attention_backend, **recompute)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-7, msg=name)


def test_dropout_makes_the_check_meaningful():
    """Without the same RNG streams the losses differ, so equality above is not an accident."""
    loss, _ = _without_recompute("auto")
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.2, attention_dropout=0.2, use_cpu_initialization=True,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    model_parallel_cuda_manual_seed(43)
    other = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean()
    assert not torch.equal(loss, other.detach())
