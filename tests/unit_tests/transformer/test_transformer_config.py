"""TransformerConfig: derived defaults and the single, complete ValueError for bad settings."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8)


def test_derived_defaults():
    config = TransformerConfig(**BASE)
    assert (config.ffn_hidden_size, config.kv_channels, config.num_query_groups) == (256, 8, 8)
    assert config.recompute_modules == ["core_attn"]
    assert config.expert_tensor_parallel_size == 1 and config.autocast_dtype == torch.float32
    torch.manual_seed(0)
    weights = torch.empty(400, 1000)
    config.init_method(weights)
    assert abs(weights.std().item() - 0.02) < 0.0005
    config.output_layer_init_method(weights)  # std / sqrt(2 * num_layers)
    assert abs(weights.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.0002
    assert weights.mean().abs().item() < 0.0005


def test_every_problem_is_reported_at_once_with_the_numbers():
    with pytest.raises(ValueError) as error:
        TransformerConfig(
            num_layers=6, hidden_size=96, num_attention_heads=12, num_query_groups=5,
            tensor_model_parallel_size=5, pipeline_model_parallel_size=4, ffn_hidden_size=102,
        )
    message = str(error.value)
    assert "5 problem(s)" in message
    assert "num_attention_heads (12) must be divisible by tensor_model_parallel_size (5)" in message
    assert "1, 2, 3, 4, 6, 12" in message
    assert "num_query_groups (5) must divide num_attention_heads (12)" in message
    assert "ffn_hidden_size (102) must be divisible by tensor_model_parallel_size (5)" in message
    assert "num_layers (6) must be divisible by pipeline_model_parallel_size (4)" in message
    assert "pipeline_dtype" in message


def test_query_groups_must_split_over_tensor_parallel_ranks_or_be_shared_by_them():
    TransformerConfig(**BASE, num_query_groups=2, tensor_model_parallel_size=4)  # 2 ranks share each group
    TransformerConfig(**BASE, num_query_groups=4, tensor_model_parallel_size=2)  # 2 groups per rank
    expected = (r"num_query_groups \(4\) must be a multiple or a divisor of tensor_model_parallel_size \(6\); "
                r"valid TP sizes: 1, 2, 4, 12")
    with pytest.raises(ValueError, match=expected):
        TransformerConfig(num_layers=2, hidden_size=96, num_attention_heads=12, num_query_groups=4,
                          tensor_model_parallel_size=6)


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(recompute_granularity="full"), r"recompute_granularity \(full\) needs recompute_method uniform or block"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "needs recompute_num_layers"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=5),
         r"recompute_num_layers \(5\) must be between 1 and the 4 layers per pipeline stage"),
        (dict(recompute_granularity="selective", recompute_num_layers=1),
         r"recompute_num_layers applies to recompute_granularity \(full\) only"),
        (dict(recompute_granularity="partial"), "must be 'full' or 'selective'"),
        (
            dict(recompute_granularity="full", recompute_method="random", recompute_num_layers=1),
            "'uniform' or 'block', got 'random'",
        ),
        (dict(recompute_granularity="selective", recompute_modules=["attn"]), "unknown recompute_modules entry 'attn'"),
        (dict(recompute_granularity="selective", recompute_modules=["moe"]), "'moe' is not supported yet"),
        (dict(recompute_granularity="selective", recompute_modules=["moe_act"]), "'moe_act' needs moe_grouped_gemm"),
        (dict(recompute_granularity="selective", recompute_modules=["layernorm"], use_torch_compile=True),
         "layernorm with use_torch_compile is not supported yet"),
    ],
)
def test_recompute_combinations(settings, expected):
    with pytest.raises(ValueError, match=expected):
        TransformerConfig(**BASE, **settings)


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(fp8="hybrid"), "fp8 needs bf16=True or fp16=True"),
        (dict(fp8="hybrid", bf16=True, fp8_recipe="mxfp8"), "fp8_recipe 'mxfp8' is not supported yet"),
        (dict(fp8="hybrid", bf16=True, kv_channels=5), "linear_qkv output .* = 120; linear_proj input .* = 40"),
        (dict(fp8="e4m3", bf16=True, num_moe_experts=4, add_bias_linear=False), "FP8 expert GEMMs\\) is not"),
        (dict(fp8="e4m3", bf16=True, first_last_layers_bf16=True, num_layers_at_start_in_bf16=2,
              num_layers_at_end_in_bf16=2), "leave at least one of the 4 layers in FP8"),
        (dict(first_last_layers_bf16=True), "first_last_layers_bf16=True needs fp8"),
        (dict(num_moe_experts=8, moe_grouped_gemm=True), "moe_grouped_gemm has no expert biases"),
        (dict(num_moe_experts=8, moe_shared_expert_intermediate_size=32), "shared experts have no biases"),
        (dict(num_moe_experts=6, expert_model_parallel_size=4, add_bias_linear=False), "EP sizes for 6 experts: 1, 2, 3, 6"),
        (dict(expert_model_parallel_size=2), "expert_model_parallel_size=2 needs num_moe_experts"),
        (dict(num_moe_experts=4, add_bias_linear=False, moe_router_topk=5), "moe_router_topk \\(5\\) must be between 1"),
        (dict(num_moe_experts=4, add_bias_linear=False, moe_router_enable_expert_bias=True), "needs moe_router_score"),
        (dict(num_moe_experts=4, add_bias_linear=False, moe_router_load_balancing_type="quantile_balancing"),
         "'quantile_balancing' is not"),
        (dict(num_moe_experts=4, add_bias_linear=False, moe_router_load_balancing_type="sinkhorn",
              moe_aux_loss_coeff=0.01), "'sinkhorn' has no auxiliary loss"),
        (dict(num_moe_experts=4, add_bias_linear=False, moe_layer_freq=[1, 0, 1]), "moe_layer_freq has 3 entries"),
        (dict(context_parallel_size=2, cp_comm_type="a2a"), "cp_comm_type 'a2a' is not supported yet"),
        (dict(sequence_parallel=True), "sequence_parallel=True needs tensor_model_parallel_size > 1"),
        (dict(fp16=True, bf16=True), "fp16 and bf16 are both True"),
        (dict(normalization="BatchNorm"), "'LayerNorm' or 'RMSNorm', got 'BatchNorm'"),
        (dict(attention_backend="cudnn"), "attention_backend 'cudnn' is not one of"),
        (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
        (dict(bias_activation_fusion=True, add_bias_linear=False), "needs add_bias_linear=True"),
        (dict(bias_activation_fusion=True, activation_func=F.silu), "needs gated_linear_unit=True"),
    ],
)
def test_invalid_or_unsupported_settings(settings, expected):
    with pytest.raises(ValueError, match=expected):
        TransformerConfig(**BASE, **settings)


def test_required_sizes_are_named():
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        TransformerConfig(hidden_size=64, num_attention_heads=8)


def test_backend_names_and_query_key_layer_scaling():
    config = TransformerConfig(
        **BASE, attention_backend="unfused", apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False
    )
    assert config.attention_backend is AttnBackend.unfused
    assert config.attention_softmax_in_fp32  # layer scaling needs the fp32 softmax
