"""--use-precision-aware-optimizer, --main-grads-dtype, --main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype:
Megatron-LM's choices and defaults, torch dtypes after validation (as Megatron-LM's validate_args makes them),
the OptimizerConfig they give, and every problem reported at once."""

import pytest
import torch

from megatron.training.arguments import optimizer_config_from_args, parse_args

from .conftest import MINIMAL

PRECISION_AWARE = ("--use-distributed-optimizer", "--use-precision-aware-optimizer")


def test_defaults_and_choices_are_megatrons():
    args = parse_args(args_list=list(MINIMAL))
    assert args.use_precision_aware_optimizer is False
    assert (args.main_grads_dtype, args.main_params_dtype, args.exp_avg_dtype, args.exp_avg_sq_dtype) == ("fp32",) * 4
    with pytest.raises(SystemExit):
        parse_args(args_list=[*MINIMAL, "--exp-avg-dtype", "fp64"])


def test_bf16_moments_become_torch_dtypes_in_the_optimizer_config(validated):
    args = validated(*MINIMAL, "--bf16", *PRECISION_AWARE, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
    assert (args.exp_avg_dtype, args.exp_avg_sq_dtype) == (torch.bfloat16, torch.bfloat16)
    assert (args.main_grads_dtype, args.main_params_dtype) == (torch.float32, torch.float32)
    config = optimizer_config_from_args(args)
    assert config.use_precision_aware_optimizer and config.use_distributed_optimizer
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.bfloat16, torch.bfloat16)
    only_second = validated(*MINIMAL, *PRECISION_AWARE, "--exp-avg-sq-dtype", "bf16")
    assert (only_second.exp_avg_dtype, only_second.exp_avg_sq_dtype) == (torch.float32, torch.bfloat16)


def test_every_problem_is_reported(problems):
    message = problems(*MINIMAL, "--use-precision-aware-optimizer", "--optimizer", "sgd", "--main-grads-dtype", "bf16",
                       "--main-params-dtype", "fp16", "--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp8")
    for expected in (
        "use_precision_aware_optimizer (--use-precision-aware-optimizer) is only supported with adam, got optimizer "
        "'sgd' (--optimizer sgd)",
        "use_precision_aware_optimizer (--use-precision-aware-optimizer) is only supported with the distributed "
        "optimizer (--use-distributed-optimizer)",
        "main_grads_dtype (--main-grads-dtype bf16) needs --bf16",
        "main_params_dtype (--main-params-dtype fp16) is not supported yet; use fp32",
        "exp_avg_dtype (--exp-avg-dtype fp16) is not supported yet; use fp32 or bf16",
        "exp_avg_sq_dtype (--exp-avg-sq-dtype fp8) is not supported yet; use fp32 or bf16",
    ):
        assert expected in message, expected


def test_a_low_precision_dtype_needs_the_precision_aware_optimizer(problems):
    message = problems(*MINIMAL, "--use-distributed-optimizer", "--exp-avg-dtype", "bf16")
    assert ("exp_avg_dtype (--exp-avg-dtype bf16) can only be fp32 when not using the precision-aware optimizer "
            "(--use-precision-aware-optimizer)") in message


def test_bf16_main_grads_keep_the_gradient_buffers_in_bf16(validated, problems):
    """Megatron-LM's rule: --main-grads-dtype bf16 leaves --accumulate-allreduce-grads-in-fp32 off under --bf16
    (DDP's buffers hold bf16, as with --grad-reduce-in-bf16), and refuses it given explicitly."""
    args = validated(*MINIMAL, "--bf16", *PRECISION_AWARE, "--main-grads-dtype", "bf16")
    assert args.main_grads_dtype == torch.bfloat16 and not args.accumulate_allreduce_grads_in_fp32
    assert optimizer_config_from_args(args).main_grads_dtype == torch.bfloat16
    assert validated(*MINIMAL, "--bf16", *PRECISION_AWARE).accumulate_allreduce_grads_in_fp32
    message = problems(*MINIMAL, "--bf16", *PRECISION_AWARE, "--main-grads-dtype", "bf16",
                       "--accumulate-allreduce-grads-in-fp32")
    assert "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set" in message
