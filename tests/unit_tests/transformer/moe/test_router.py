"""TopKRouter against hand-worked routings and the balancing formulas written out independently."""

import math

import pytest
import torch

from megatron.core.transformer.moe.load_balancing import get_updated_expert_bias
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter, topk_routing_with_capacity
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**overrides):
    fields = dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=4, add_bias_linear=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _softmax(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def _sigmoid(value):
    return 1 / (1 + math.exp(-value))


LOGITS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 1.0]])


def test_softmax_after_topk():
    probs, routing_map = topk_routing_with_capacity(LOGITS, topk=2)
    expected = torch.zeros(2, 4)
    expected[0, 2], expected[0, 1] = _softmax([3.0, 2.0])
    expected[1, 2], expected[1, 3] = _softmax([5.0, 1.0])
    torch.testing.assert_close(probs, expected)
    assert routing_map.tolist() == [[False, True, True, False], [False, False, True, True]]


def test_softmax_before_topk():
    probs, _ = topk_routing_with_capacity(LOGITS, topk=2, use_pre_softmax=True)
    first, second = _softmax([1.0, 2.0, 3.0, 0.0]), _softmax([0.0, 0.0, 5.0, 1.0])
    expected = torch.tensor([[0.0, first[1], first[2], 0.0], [0.0, 0.0, second[2], second[3]]])
    torch.testing.assert_close(probs, expected)


def test_sigmoid_with_expert_bias_chooses_by_biased_score_and_weights_by_unbiased():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs, routing_map = topk_routing_with_capacity(
        logits, topk=2, score_function="sigmoid", expert_bias=torch.tensor([5.0, 0.0, 0.0, 0.0])
    )
    assert routing_map.tolist() == [[True, False, True, False]]
    total = _sigmoid(0.0) + _sigmoid(2.0)
    torch.testing.assert_close(probs, torch.tensor([[_sigmoid(0.0) / total, 0.0, _sigmoid(2.0) / total, 0.0]]))


# Four tokens, two experts, top-1 on softmax scores; capacity = ceil(4 * 1 / 2 * 1.0) = 2.
# Expert 0 is the choice of tokens 0, 1, 2 with probabilities sigmoid(1) < sigmoid(2) < sigmoid(3).
DROP_LOGITS = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.0, 1.0]])


@pytest.mark.parametrize(
    "policy, kept", [("probs", [False, True, True, True]), ("position", [True, True, False, True])]
)
def test_token_dropping_by_hand(policy, kept):
    probs, routing_map = topk_routing_with_capacity(
        DROP_LOGITS, topk=1, use_pre_softmax=True, capacity_factor=1.0, drop_policy=policy
    )
    assert routing_map.any(dim=1).tolist() == kept
    for token, is_kept in enumerate(kept):
        expert = 0 if token < 3 else 1
        logit = DROP_LOGITS[token, expert].item() - DROP_LOGITS[token, 1 - expert].item()
        assert probs[token, expert].item() == pytest.approx(_sigmoid(logit) if is_kept else 0.0)
        assert probs[token, 1 - expert].item() == 0.0


def _reference_balancing(logits, topk, probs_fn):
    """E * sum_i f_i * P_i with f_i = share of the T*k routed slots, P_i = mean score."""
    scores = probs_fn(logits)
    tokens, experts = scores.shape
    chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, topk, dim=1).indices, 1.0)
    fraction = chosen.sum(0) / (tokens * topk)
    return experts * torch.sum(fraction * scores.mean(0))


def _router_with_weight(config, seed=0):
    torch.manual_seed(seed)
    router = TopKRouter(config)
    router.set_layer_number(1)
    return router


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_and_z_loss_values_and_gradient(score_function):
    config = _config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_router_score_function=score_function)
    router = _router_with_weight(config)
    clear_aux_losses_tracker()
    # The backward scale is process-wide; a training run earlier in this worker may have left 1/microbatches.
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    x = torch.randn(6, 8)
    probs, _ = router(x, seq_length=6, batch_size=1)
    upstream = torch.randn(6, 4)
    (probs * upstream).sum().backward()

    weight = router.weight.detach().clone().requires_grad_(True)
    logits = x @ weight.t()
    if score_function == "softmax":
        ref_probs, _ = topk_routing_with_capacity(logits, 2)
        score_fn = lambda value: torch.softmax(value, dim=-1)  # noqa: E731
    else:
        ref_probs, _ = topk_routing_with_capacity(logits, 2, score_function="sigmoid")
        score_fn = lambda value: torch.sigmoid(value) / torch.sigmoid(value).sum(-1, keepdim=True)  # noqa: E731
    balancing = _reference_balancing(logits, 2, score_fn)
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    ((ref_probs * upstream).sum() + 0.1 * balancing + 0.01 * z_loss).backward()

    tracker = get_moe_layer_wise_logging_tracker()
    torch.testing.assert_close(tracker["load_balancing_loss"][0], balancing.detach())
    torch.testing.assert_close(tracker["z_loss"][0], z_loss.detach())
    torch.testing.assert_close(router.weight.grad, weight.grad)
    clear_aux_losses_tracker()


def test_sequence_aux_loss_is_the_mean_over_sequences():
    config = _config(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="seq_aux_loss")
    router = _router_with_weight(config, seed=1)
    clear_aux_losses_tracker()
    seq, batch = 5, 3
    x = torch.randn(seq * batch, 8)
    router(x, seq_length=seq, batch_size=batch)
    logits = (x @ router.weight.t()).view(seq, batch, 4)  # token t = position * batch + sample
    per_sequence = [_reference_balancing(logits[:, b], 2, lambda v: torch.softmax(v, -1)) for b in range(batch)]
    value = get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"][0]
    torch.testing.assert_close(value, torch.stack(per_sequence).mean())
    clear_aux_losses_tracker()


def test_router_counts_tokens_for_the_expert_bias_and_bias_moves_by_the_sign():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=1)
    router = _router_with_weight(config)
    x = torch.randn(10, 8)
    _, routing_map = router(x, seq_length=10, batch_size=1)
    torch.testing.assert_close(router.local_tokens_per_expert, routing_map.sum(0).float())
    counts = torch.tensor([[4.0, 1.0, 3.0, 0.0]])  # mean 2: experts 0, 2 over-loaded, 1, 3 under-loaded
    updated = get_updated_expert_bias(counts, torch.zeros(1, 4), 0.5)
    assert updated.tolist() == [[-0.5, 0.5, -0.5, 0.5]]
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()


def test_sinkhorn_balances_a_skewed_router_and_weights_by_the_logits():
    """Every token prefers expert 0; in training the experts are the top-1 of Sinkhorn's doubly-normalised
    matrix (which spreads the tokens), weighted by the sigmoid of the raw logits; in evaluation the plain top-1
    of those weights (all expert 0)."""
    from megatron.core.transformer.moe.load_balancing import sinkhorn, sinkhorn_routing

    torch.manual_seed(0)
    logits = torch.randn(8, 4) * 0.1
    logits[:, 0] += 3.0
    balanced = sinkhorn(logits)
    torch.testing.assert_close(balanced.sum(dim=0), torch.full((4,), 1 / 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(balanced.sum(dim=1), torch.full((8,), 1 / 8), atol=1e-4, rtol=0)
    probs, routing_map = sinkhorn_routing(logits, topk=1, training=True)
    assert routing_map.nonzero()[:, 1].tolist() == balanced.argmax(dim=1).tolist()
    assert routing_map.sum(dim=0).max() < 8 and routing_map.sum(dim=1).tolist() == [1] * 8
    torch.testing.assert_close(probs, torch.sigmoid(logits) * routing_map)
    _, evaluated = sinkhorn_routing(logits, topk=1, training=False)
    assert evaluated[:, 0].all()
    probs, routing_map = sinkhorn_routing(logits, topk=2, training=True)
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1) * routing_map)
    router = TopKRouter(_config(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1))
    router.weight.data.zero_()
    router.weight.data[0, 0] = 5.0  # every token with a positive first feature prefers expert 0
    hidden = torch.randn(8, 8).abs()
    _, routing_map = router(hidden, seq_length=8, batch_size=1)
    assert routing_map.sum(dim=0).max() < 8  # plain top-1 would send all 8 tokens to expert 0
