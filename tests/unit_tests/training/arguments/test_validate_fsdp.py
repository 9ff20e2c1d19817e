"""--use-torch-fsdp2 and --use-megatron-fsdp --data-parallel-sharding-strategy: what each strategy turns into,
the config the model is wrapped with, and the combinations refused with their reason."""

import pytest
import torch

from megatron.core.distributed import TorchFullyShardedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import (
    shards_params,
    shards_params_on_buffers,
    uses_distributed_optimizer,
)
from megatron.training.arguments import ddp_config_from_args

from .conftest import MINIMAL


@pytest.fixture(autouse=True)
def two_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.parametrize("strategy, distributed_optimizer, sharded", [
    ("no_shard", False, False), ("optim", True, False), ("optim_grads", True, False),
    ("optim_grads_params", True, False),
])
def test_each_strategy_picks_its_optimizer_and_wrapper(validated, strategy, distributed_optimizer, sharded):
    args = validated(*MINIMAL, "--bf16", "--use-megatron-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather", "--data-parallel-sharding-strategy", strategy)
    ddp_config = ddp_config_from_args(args)
    assert args.use_distributed_optimizer == distributed_optimizer == uses_distributed_optimizer(ddp_config)
    assert shards_params(ddp_config) == sharded
    assert args.overlap_param_gather == (strategy != "no_shard")  # no_shard gathers nothing


def test_megatron_fsdp_defaults_to_zero_3(validated):
    args = validated(*MINIMAL, "--use-megatron-fsdp")
    ddp_config = ddp_config_from_args(args)
    assert args.data_parallel_sharding_strategy == "optim_grads_params" and shards_params_on_buffers(ddp_config)
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    assert not shards_params(ddp_config)


def test_torch_fsdp2_config_carries_reshard_after_forward(validated):
    config = ddp_config_from_args(validated(*MINIMAL, "--use-torch-fsdp2"))
    assert isinstance(config, TorchFullyShardedDataParallelConfig) and config.reshard_after_forward
    args = validated(*MINIMAL, "--bf16", "--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward")
    config = ddp_config_from_args(args)
    assert (config.reshard_after_forward, config.grad_reduce_in_fp32) == (False, True)


@pytest.mark.parametrize("flags, expected", [
    (["--use-torch-fsdp2", "--use-megatron-fsdp"], "--use-torch-fsdp2 and --use-megatron-fsdp are two implementations"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"], "--use-torch-fsdp2 shards the optimizer state itself"),
    (["--use-torch-fsdp2", "--expert-model-parallel-size", "2", "--num-experts", "2"],
     "--use-torch-fsdp2 with --expert-model-parallel-size 2 is not supported yet"),
    (["--use-megatron-fsdp", "--fp16"],
     "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params with --fp16 is not supported yet"),
    (["--use-torch-fsdp2", "--save", "ckpt", "--save-interval", "5", "--ckpt-format", "torch"],
     "--use-torch-fsdp2 saves and loads --ckpt-format torch_dist only"),
    (["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2"],
     "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params with "
     "--num-distributed-optimizer-instances 2 is not supported yet"),
    (["--use-megatron-fsdp", "--save", "ckpt", "--save-interval", "5", "--ckpt-format", "torch"],
     "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params saves and loads --ckpt-format "
     "torch_dist only"),
    (["--use-torch-fsdp2", "--overlap-param-gather", "--overlap-grad-reduce"],
     "--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)"),
])
def test_refused_with_the_reason(problems, flags, expected):
    assert expected in problems(*MINIMAL, *flags)


def test_strategies_without_sharded_params_take_what_ddp_takes(validated):
    args = validated(*MINIMAL, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--fp16",
                     "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--micro-batch-size", "1")
    assert args.use_distributed_optimizer and args.fp16


@pytest.mark.parametrize("strategy, dtypes, refused", [
    # What Megatron-LM's Megatron-FSDP test configurations pass: what the wrappers here build under --bf16.
    ("optim_grads_params", ("fp32", "fp32", "fp32"), []),
    ("no_shard", ("fp32", "fp32", "fp32"), []),
    ("optim_grads_params", ("bf16", "auto", "auto"), ["main-params"]),
    # auto main params: the model's bf16; the reduction follows the main grads
    ("optim_grads_params", ("auto", "bf16", "auto"), ["main-params", "main-grads", "grad-comm"]),
])
def test_megatron_fsdp_dtypes_built_or_refused(validated, strategy, dtypes, refused):
    flags = [*MINIMAL, "--bf16", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    for name, dtype in zip(("main-params", "main-grads", "grad-comm"), dtypes):
        flags += [f"--megatron-fsdp-{name}-dtype", dtype]
    if not refused:
        assert validated(*flags).megatron_fsdp_grad_comm_dtype == torch.float32
        return
    with pytest.raises(ValueError) as error:
        validated(*flags)
    assert len(str(error.value).splitlines()) == 1 + len(refused)
    for name in refused:
        assert f"(--megatron-fsdp-{name}-dtype) bf16 is not supported yet" in str(error.value)


@pytest.mark.parametrize("blackwell", [False, True])
def test_fsdp_puts_the_data_parallel_collectives_on_high_priority_streams_as_megatron_does(validated, monkeypatch,
                                                                                        blackwell):
    """Megatron-LM's rule, as its code reads: always with --use-torch-fsdp2, with --use-megatron-fsdp from
    compute capability 10 on; the user's groups are kept."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: blackwell)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *unused: (10, 0))
    fsdp2 = validated(*MINIMAL, "--bf16", "--use-torch-fsdp2", "--high-priority-stream-groups", "tp")
    assert fsdp2.high_priority_stream_groups == ["tp", "dp_cp"]
    megatron_fsdp = validated(*MINIMAL, "--use-megatron-fsdp")
    assert megatron_fsdp.high_priority_stream_groups == (["dp_cp"] if blackwell else [])
    assert validated(*MINIMAL, "--use-distributed-optimizer").high_priority_stream_groups == []
