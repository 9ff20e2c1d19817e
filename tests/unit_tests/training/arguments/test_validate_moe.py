"""MoE flags: Megatron's --moe-layer-freq syntax, one-element lists, and the checks that name flags."""

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.validate_moe import parse_layer_freq
from megatron.training.training_log import num_floating_point_operations

from .conftest import MINIMAL

MOE = MINIMAL + ["--num-experts", "4", "--disable-bias-linear"]


@pytest.mark.parametrize("text, expected", [
    ("1", 1), ("3", 3), ("[1,0,1,0]", [1, 0, 1, 0]), ("([1]*3+[0]*1)*2", [1, 1, 1, 0] * 2), ("[0]+[1]*2", [0, 1, 1]),
])
def test_moe_layer_freq_syntax(text, expected):
    assert parse_layer_freq(text) == expected


@pytest.mark.parametrize("text", ["__import__('os')", "[1,0]*x", "abc", "1.5"])
def test_moe_layer_freq_refuses_anything_else(text):
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_layer_freq(text)


def test_moe_run_validates_and_builds_the_config(validated):
    args = validated(*MOE, "--moe-layer-freq", "[1,0]", "--moe-router-load-balancing-type", "seq_aux_loss",
                     "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid",
                     "--moe-router-enable-expert-bias", "--moe-ffn-hidden-size", "96")
    assert args.moe_layer_freq == [1, 0] and args.moe_router_load_balancing_type == "seq_aux_loss"
    assert args.moe_aux_loss_coeff == 0.01
    config = core_transformer_config_from_args(args)
    assert isinstance(config, TransformerConfig)
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_layer_freq) == (4, 96, [1, 0])
    assert config.moe_router_enable_expert_bias and config.moe_router_score_function == "sigmoid"


@pytest.mark.parametrize("flags, world, expected", [
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs --num-experts"),
    (MOE[len(MINIMAL):] + ["--expert-model-parallel-size", "3"], 3, "valid EP sizes: 1, 2, 4"),
    (["--num-experts", "4", "--moe-grouped-gemm"], 1, "--moe-grouped-gemm has no expert biases"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"], 1, "shared experts have no biases"),
    (MOE[len(MINIMAL):] + ["--moe-router-topk", "5"], 1, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (MOE[len(MINIMAL):] + ["--moe-router-enable-expert-bias"], 1, "needs --moe-router-score-function sigmoid"),
    (MOE[len(MINIMAL):] + ["--moe-layer-freq", "[1,0,1]"], 1, "--moe-layer-freq has 3 entries but --num-layers is 2"),
    (MOE[len(MINIMAL):] + ["--moe-aux-loss-coeff", "0.1", "0.2"], 1, "combining several load-balancing losses"),
    (MOE[len(MINIMAL):] + ["--expert-tensor-parallel-size", "0"], 1, "--expert-tensor-parallel-size 0 must be at"),
    (MOE[len(MINIMAL):] + ["--expert-tensor-parallel-size", "2", "--ckpt-format", "torch", "--save", "ckpt",
                           "--save-interval", "5"], 2,
     "needs --expert-tensor-parallel-size 2 to divide --tensor-model-parallel-size 1; use --ckpt-format torch_dist"),
])
def test_moe_problems_name_the_flags(problems, monkeypatch, flags, world, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert expected in problems(*MINIMAL, *flags)


def test_flops_count_the_experts_a_token_visits(validated):
    """Megatron's formula: an MoE layer's MLP term is topk * moe_ffn + shared width instead of ffn."""
    dense = validated(*MINIMAL, "--ffn-hidden-size", "128", "--disable-bias-linear")
    one_expert_per_token = validated(*MOE, "--ffn-hidden-size", "128", "--moe-router-topk", "1")
    wider = validated(*MOE, "--ffn-hidden-size", "128", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
                      "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "2")
    for args in (dense, one_expert_per_token, wider):
        args.padded_vocab_size = 512  # set by the tokenizer at start-up
    assert num_floating_point_operations(one_expert_per_token, 8) == num_floating_point_operations(dense, 8)
    # Layer 0: 2 * 64 + 32 = 160 wide; layer 1 dense, 128: the MLP term grows by 12 h (160 - 128) per token.
    extra = 8 * 32 * 12 * 64 * (160 - 128)
    assert num_floating_point_operations(wider, 8) - num_floating_point_operations(dense, 8) == extra
