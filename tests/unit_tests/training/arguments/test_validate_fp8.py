"""The FP8 flags: Megatron's FP8 command lines validate and reach TransformerConfig; mistakes are listed with
their numbers."""

import pytest

from megatron.training.arguments.core_configs import core_transformer_config_from_args, ddp_config_from_args

from .conftest import MINIMAL


def test_megatron_fp8_flags_reach_the_transformer_config(validated):
    args = validated(*MINIMAL, "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                     "--fp8-amax-compute-algo", "max", "--fp8-margin", "1", "--no-fp8-wgrad")
    config = core_transformer_config_from_args(args)
    assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (
        "hybrid", "delayed", 1024, "max")
    assert config.fp8_margin == 1 and config.fp8_wgrad is False and config.bf16


def test_megatron_llama3_fp8_param_gather_flags_reach_the_configs(validated):
    """examples/llama/train_llama3_8b_h100_fp8.sh's FP8 and data-parallel flags."""
    args = validated(*MINIMAL, "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                     "--fp8-amax-compute-algo", "max", "--fp8-param-gather", "--use-distributed-optimizer",
                     "--overlap-grad-reduce", "--overlap-param-gather", "--grad-reduce-in-bf16")
    assert core_transformer_config_from_args(args).fp8_param is True
    ddp_config = ddp_config_from_args(args)
    assert ddp_config.fp8_param_gather and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather


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
    (["--bf16", "--fp8-param-gather", "--use-distributed-optimizer"],
     "--fp8-param-gather must be used together with --fp8-format"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"],
     "--fp8-param-gather only supported with distributed optimizer (Megatron-LM's rule, which also allows FSDP and "
     "inference mode): add --use-distributed-optimizer"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather", "--use-torch-fsdp2", "--ckpt-format", "torch_dist",
      "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"],
     "--fp8-param-gather with --use-torch-fsdp2: Megatron-LM turns it off there"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather", "--use-megatron-fsdp",
      "--data-parallel-sharding-strategy", "optim_grads_params", "--use-distributed-optimizer"],
     "--fp8-param-gather with --use-megatron-fsdp is not supported yet"),
])
def test_problems_are_named(problems, flags, expected):
    assert expected in problems(*MINIMAL, *flags)
