"""Qwen3-Next's layers against Hugging Face transformers' (modeling_qwen3_next, its PyTorch fallbacks): the
chunked gated delta rule, the Gated DeltaNet layer, softmax attention with the output gate, and the gated
shared expert, each with the same weights in fp32 on tiny shapes.

Weight maps (ours -> Hugging Face): GatedDeltaNet's in_proj rows [q; k; v; z; beta; alpha] (each block in
head order) are Hugging Face's in_proj_qkvz / in_proj_ba, which group them per key head: [q_i, k_i, the
value heads of key head i, their z] and [their beta, their alpha]; conv1d, A_log, dt_bias, out_proj are the
same; out_norm (RMSNorm) is the gated norm's weight. SelfAttention's linear_qkv rows per key/value group g
are [queries of g; their gates; key g; value g], Hugging Face's q_proj [q_h; gate_h] per head plus k_proj
and v_proj; its RMSNorm q/k norms store w - 1 (--apply-layernorm-1p).

Tolerances (fp32), relative to the largest entry: the delta rule within 2e-6 of the exact recurrence (at chunk
sizes that split the sequence unevenly); attention and the shared expert within 1e-5 (measured <= 1e-6);
the Gated DeltaNet layer within 3e-5 (measured 1.1e-5, in the A_log gradient: Hugging Face's fp32 chunked
fallback, which solves the chunk's triangular system row by row, is that far from the exact recurrence; with
its exact recurrence in fp64 as the reference the layer is within 1e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net.delta_rule import chunk_gated_delta_rule, l2norm
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN, SEQ, BATCH = 32, 11, 2
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 8, 6


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("chunk_size", [64, 4])
def test_chunked_delta_rule_matches_the_recurrence(chunk_size):
    torch.manual_seed(0)
    q, k = (l2norm(torch.randn(2, 37, 3, 8)) for _ in range(2))
    v, g, beta = torch.randn(2, 37, 3, 5), -2 * torch.rand(2, 37, 3), torch.rand(2, 37, 3)
    inputs = [tensor.requires_grad_() for tensor in (q, k, v, g, beta)]
    expected, _ = hf.torch_recurrent_gated_delta_rule(*inputs, initial_state=None, output_final_state=False)
    actual = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size)
    assert _relative(actual, expected) < 2e-6
    weights = torch.randn_like(expected)
    for got, want in zip(torch.autograd.grad((actual * weights).sum(), inputs),
                         torch.autograd.grad((expected * weights).sum(), inputs)):
        assert _relative(got, want) < 2e-6


def _config(**extra) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2, **extra,
    )


def _hf_config(**extra) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4, linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM,
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS, attention_dropout=0.0,
        attn_implementation="eager", **extra,
    )


def _compare(ours, theirs, hidden: torch.Tensor, param_pairs, tolerance: float = 1e-5) -> None:
    """Outputs of ours ([s, b, h] in, (out, bias) back) and theirs ([b, s, h]), input and parameter grads."""
    mine, theirs_in = hidden.clone().requires_grad_(), hidden.transpose(0, 1).clone().requires_grad_()
    out, bias = ours(mine)
    assert bias is None
    expected = theirs(theirs_in).transpose(0, 1)
    assert _relative(out, expected) < tolerance
    weights = torch.randn_like(expected)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    assert _relative(mine.grad, theirs_in.grad.transpose(0, 1)) < tolerance
    for ours_grad, theirs_grad in param_pairs():
        assert _relative(ours_grad, theirs_grad) < tolerance


def test_gated_delta_net_matches_qwen3_next():
    torch.manual_seed(3)
    config = _config(experimental_attention_variant="gdn", linear_attention_freq=2,
                     linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_num_key_heads=KEY_HEADS,
                     linear_num_value_heads=VALUE_HEADS)
    ours = build_module(get_gated_delta_net_module_spec(config), config=config, layer_number=1)
    theirs = hf.Qwen3NextGatedDeltaNet(_hf_config(), layer_idx=0)
    with torch.no_grad():
        ours.out_norm.weight.uniform_(0.5, 1.5)
        theirs.conv1d.weight.copy_(ours.conv1d.weight)
        theirs.A_log.copy_(ours.A_log)
        theirs.dt_bias.uniform_(0.5, 1.5)
        ours.dt_bias.copy_(theirs.dt_bias)
        theirs.norm.weight.copy_(ours.out_norm.weight)
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        qkvz, ba = _qwen3_next_in_proj(ours.in_proj.weight)
        theirs.in_proj_qkvz.weight.copy_(qkvz)
        theirs.in_proj_ba.weight.copy_(ba)

    def grads():
        qkvz, ba = _qwen3_next_in_proj(ours.in_proj.weight.grad)
        yield qkvz, theirs.in_proj_qkvz.weight.grad
        yield ba, theirs.in_proj_ba.weight.grad
        for name in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
            yield ours.get_parameter(name).grad, theirs.get_parameter(name).grad
        yield ours.out_norm.weight.grad, theirs.norm.weight.grad

    _compare(ours, theirs, torch.randn(SEQ, BATCH, HIDDEN), grads, tolerance=3e-5)


def _qwen3_next_in_proj(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [q; k; v; z; beta; alpha] rows as Hugging Face's per-key-head in_proj_qkvz and in_proj_ba."""
    qk, v_dim = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
    q, k, v, z, beta, alpha = weight.split([qk, qk, v_dim, v_dim, VALUE_HEADS, VALUE_HEADS])
    per_head = lambda block: block.chunk(KEY_HEADS)  # noqa: E731 - the key head's share of a block
    qkvz = torch.cat([torch.cat(parts) for parts in zip(*map(per_head, (q, k, v, z)))])
    ba = torch.cat([torch.cat(parts) for parts in zip(*map(per_head, (beta, alpha)))])
    return qkvz, ba


def test_attention_output_gate_matches_qwen3_next():
    torch.manual_seed(4)
    config = _config(attention_output_gate=True, qk_layernorm=True, layernorm_zero_centered_gamma=True)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.self_attention
    ours = build_module(spec, config=config, layer_number=1)
    theirs = hf.Qwen3NextAttention(_hf_config(), layer_idx=0)
    heads, groups, hn = 4, 2, 8
    cos, sin = torch.ones(BATCH, SEQ, hn), torch.zeros(BATCH, SEQ, hn)  # no rotation: the positions are RoPE's
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(BATCH, 1, SEQ, SEQ)
    with torch.no_grad():
        for norm in (ours.q_layernorm, ours.k_layernorm):
            norm.weight.uniform_(-0.3, 0.3)
        theirs.q_norm.weight.copy_(ours.q_layernorm.weight)
        theirs.k_norm.weight.copy_(ours.k_layernorm.weight)
        rows = ours.linear_qkv.weight.view(groups, 2 * heads // groups + 2, hn, HIDDEN)
        query, gate, key, value = rows.split([heads // groups, heads // groups, 1, 1], dim=1)
        theirs.q_proj.weight.copy_(torch.stack([query, gate], dim=2).reshape(-1, HIDDEN))  # per head [q_h; gate_h]
        theirs.k_proj.weight.copy_(key.reshape(-1, HIDDEN))
        theirs.v_proj.weight.copy_(value.reshape(-1, HIDDEN))
        theirs.o_proj.weight.copy_(ours.linear_proj.weight)

    def attention(hidden):
        return theirs(hidden, (cos, sin), mask)[0]

    def grads():
        rows = ours.linear_qkv.weight.grad.view(groups, 2 * heads // groups + 2, hn, HIDDEN)
        query, gate, key, value = rows.split([heads // groups, heads // groups, 1, 1], dim=1)
        yield torch.stack([query, gate], dim=2).reshape(-1, HIDDEN), theirs.q_proj.weight.grad
        yield key.reshape(-1, HIDDEN), theirs.k_proj.weight.grad
        yield ours.linear_proj.weight.grad, theirs.o_proj.weight.grad
        yield ours.q_layernorm.weight.grad, theirs.q_norm.weight.grad

    _compare(lambda hidden: ours(hidden, None), attention, torch.randn(SEQ, BATCH, HIDDEN), grads)


def test_gated_shared_expert_matches_qwen3_next():
    torch.manual_seed(5)
    config = _config(num_moe_experts=2, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    ours = SharedExpertMLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                           ffn_hidden_size=24)
    expert = hf.Qwen3NextMLP(_hf_config(), intermediate_size=24)
    gate = torch.nn.Linear(HIDDEN, 1, bias=False)  # Qwen3NextSparseMoeBlock.shared_expert_gate
    with torch.no_grad():
        gate_rows, up_rows = ours.linear_fc1.weight.chunk(2)
        expert.gate_proj.weight.copy_(gate_rows)
        expert.up_proj.weight.copy_(up_rows)
        expert.down_proj.weight.copy_(ours.linear_fc2.weight)
        gate.weight.copy_(ours.gate_weight)

    def grads():
        yield ours.gate_weight.grad, gate.weight.grad
        yield ours.linear_fc2.weight.grad, expert.down_proj.weight.grad

    _compare(ours, lambda hidden: torch.sigmoid(gate(hidden)) * expert(hidden), torch.randn(SEQ, BATCH, HIDDEN), grads)
