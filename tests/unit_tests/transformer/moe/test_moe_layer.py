"""A single-process MoE layer against a plain-torch reference that runs each token through its experts
one by one, with the weights read from the layer's Megatron-Core state-dict keys."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

H, FFN, SHARED, E = 8, 12, 16, 4


def _build(grouped: bool, **overrides):
    fields = dict(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_ffn_hidden_size=FFN,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
    )
    fields.update(overrides)
    config = TransformerConfig(**fields)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=grouped).submodules.mlp
    layer = build_module(spec, config=config)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.5)
    return layer


def _expert_weights(state, grouped: bool, expert: int):
    """(fc1, fc2, fc1 bias, fc2 bias) of one expert; the biases are None where the layer has none."""
    if grouped:
        return state[f"experts.linear_fc1.weight{expert}"], state[f"experts.linear_fc2.weight{expert}"], None, None
    prefix = f"experts.local_experts.{expert}."
    return tuple(state.get(prefix + name) for name in
                 ("linear_fc1.weight", "linear_fc2.weight", "linear_fc1.bias", "linear_fc2.bias"))


def _swiglu_mlp(x, fc1, fc2, fc1_bias=None, fc2_bias=None):
    gate, up = F.linear(x, fc1, fc1_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2, fc2_bias)


def _reference(layer, grouped, x, topk=2):
    """out_t = sum over the k highest router logits e of softmax(top-k logits)_e * expert_e(x_t)."""
    state = layer.state_dict(keep_vars=True)
    tokens = x.reshape(-1, H)
    logits = tokens @ state["router.weight"].t()
    outputs = []
    for token, token_logits in zip(tokens, logits):
        top = torch.topk(token_logits, topk)
        weights = torch.softmax(top.values, dim=0)
        out = sum(
            w * _swiglu_mlp(token, *_expert_weights(state, grouped, int(e))) for w, e in zip(weights, top.indices)
        )
        if "shared_experts.linear_fc1.weight" in state:
            out = out + _swiglu_mlp(token, state["shared_experts.linear_fc1.weight"],
                                    state["shared_experts.linear_fc2.weight"])
        outputs.append(out)
    return torch.stack(outputs).view_as(x)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("shared", [None, SHARED])
def test_moe_layer_equals_expert_by_expert_reference(grouped, shared):
    _assert_equals_reference(_build(grouped, moe_shared_expert_intermediate_size=shared), grouped)


def test_expert_biases_equal_the_reference():
    """add_bias_linear (the loop path): fc1 and fc2 biases, drawn at random here, inside each expert."""
    layer = _build(False, add_bias_linear=True)
    assert "experts.local_experts.3.linear_fc2.bias" in layer.state_dict()
    _assert_equals_reference(layer, grouped=False)


def _assert_equals_reference(layer, grouped: bool):
    x = torch.randn(5, 3, H, requires_grad=True)
    output, bias = layer(x)
    assert bias is None
    x_ref = x.detach().clone().requires_grad_(True)
    expected = _reference(layer, grouped, x_ref)
    torch.testing.assert_close(output, expected)

    upstream = torch.randn_like(output)
    grads = torch.autograd.grad((output * upstream).sum(), [x] + list(layer.parameters()))
    ref_output = _reference(layer, grouped, x_ref)
    ref_grads = torch.autograd.grad((ref_output * upstream).sum(), [x_ref] + list(layer.parameters()))
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad)


def test_state_dict_keys_are_megatron_core_names():
    sequential = set(_build(False, moe_shared_expert_intermediate_size=SHARED).state_dict())
    grouped = set(_build(True).state_dict())
    assert "router.weight" in sequential and "shared_experts.linear_fc2.weight" in sequential
    assert {f"experts.local_experts.{i}.linear_fc{j}.weight" for i in range(E) for j in (1, 2)} <= sequential
    assert {f"experts.linear_fc{j}.weight{i}" for i in range(E) for j in (1, 2)} <= grouped
    assert _build(False).state_dict()["experts.local_experts.0.linear_fc1.weight"].shape == (2 * FFN, H)


@pytest.mark.parametrize("policy, dropped", [("probs", 0), ("position", 2)])
def test_dropped_token_gets_zero_from_the_experts(policy, dropped):
    """Top-1 over two experts with capacity 2 (= ceil(4 / 2 * 1.0)): three tokens want expert 0 with
    softmax weights sigmoid(1) < sigmoid(3), sigmoid(2); "probs" drops token 0, "position" token 2."""
    layer = _build(False, num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True,
                   moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # logits = (x_0, x_1)
        layer.router.weight[1, 1] = 1.0
    x = torch.zeros(4, 1, H)
    x[:, 0, 0] = torch.tensor([1.0, 3.0, 2.0, 0.0])
    x[:, 0, 1] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    x[:, 0, 2:] = torch.randn(4, H - 2)
    output, _ = layer(x)
    state = layer.state_dict()
    for token in range(4):
        if token == dropped:
            assert torch.count_nonzero(output[token]) == 0
            continue
        expert = 0 if token < 3 else 1
        weight = torch.sigmoid(x[token, 0, expert] - x[token, 0, 1 - expert])
        expected = weight * _swiglu_mlp(x[token, 0], *_expert_weights(state, False, expert))
        torch.testing.assert_close(output[token, 0], expected)
