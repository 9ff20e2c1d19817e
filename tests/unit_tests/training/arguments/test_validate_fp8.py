"""The FP8 flags: Megatron's FP8 command lines validate and reach TransformerConfig; mistakes are listed with
their numbers."""

import pytest

from megatron.training.arguments.core_configs import core_transformer_config_from_args

from .conftest import MINIMAL


def test_megatron_fp8_flags_reach_the_transformer_config(validated):
    args = validated(*MINIMAL, "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                     "--fp8-amax-compute-algo", "max", "--fp8-margin", "1", "--no-fp8-wgrad")
    config = core_transformer_config_from_args(args)
    assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (
        "hybrid", "delayed", 1024, "max")
    assert config.fp8_margin == 1 and config.fp8_wgrad is False and config.bf16


def test_first_and_last_layers_in_bf16(validated):
    args = validated(*MINIMAL, "--num-layers", "6", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                     "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2")
    config = core_transformer_config_from_args(args)
    assert (config.first_last_layers_bf16, config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16) == (
        True, 2, 1)


@pytest.mark.parametrize("flags, expected", [
    (["--fp8-format", "hybrid"], "--fp8-format hybrid: needs --bf16 or --fp16"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16"],
     "--fp8-amax-history-len 16 / --fp8-amax-compute-algo most_recent belong to --fp8-recipe delayed"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be >= 1"),
    (["--bf16", "--fp8-format", "e4m3", "--first-last-layers-bf16"],
     "--num-layers-at-start-in-bf16 1 + --num-layers-at-end-in-bf16 1 must be >= 0 each and leave at least one of "
     "the 2 layers in FP8"),
    (["--bf16", "--first-last-layers-bf16"], "--first-last-layers-bf16 needs --fp8-format"),
    (["--bf16", "--fp8-format", "hybrid", "--ffn-hidden-size", "200"],
     "--fp8-format hybrid: FP8 GEMMs (torch._scaled_mm) need sizes that are multiples of 16: linear_fc1 output "
     "ffn / TP = 200 / 1 = 200; linear_fc2 input ffn / TP = 200 / 1 = 200"),
    (["--bf16", "--fp8-format", "hybrid", "--num-experts", "4", "--disable-bias-linear"],
     "--fp8-format hybrid: FP8 for MoE experts (--num-experts 4) is not supported yet"),
])
def test_problems_are_named(problems, flags, expected):
    assert expected in problems(*MINIMAL, *flags)
