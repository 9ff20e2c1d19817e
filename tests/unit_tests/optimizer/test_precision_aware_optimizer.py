"""Adam moments in bf16 (--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) on a CPU:
fusions/adamw_reference.py's step against torch's AdamW and Adam (fp32 moments: bit for bit), bf16 moments as
the rounded fp32 ones, a tiny GPT trained with the distributed optimizer either way, the GPU's Triton step
against the reference, and OptimizerConfig's checks (Megatron-LM's, and "not supported yet" for the dtypes not
built)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.fusions.adamw_reference import adamw_step
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.training.checkpointing.conftest import single_rank  # noqa: F401 (the fixture)
from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args, train_steps

SHAPES = ((37,), (16, 24), (3, 129))
BF16, FP32 = torch.bfloat16, torch.float32


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3}]


@pytest.mark.parametrize("adam_class", [torch.optim.AdamW, torch.optim.Adam])
def test_reference_step_with_fp32_moments_is_torch_adam_bit_for_bit(adam_class):
    ours, theirs = _params(), _params()
    optimizer = adam_class(_groups(ours), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    torch_optimizer = adam_class(_groups(theirs), lr=1e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    for step in range(4):
        grad_scale = torch.tensor([1.0 + step]) if step % 2 else None
        for mine, reference in zip(ours, theirs):
            mine.grad = torch.randn_like(mine)
            reference.grad = mine.grad / grad_scale if grad_scale is not None else mine.grad.clone()
        adamw_step(optimizer, FP32, FP32, grad_scale)
        torch_optimizer.step()
        for mine, reference in zip(ours, theirs):
            assert torch.equal(mine, reference)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optimizer.state[mine][key], torch_optimizer.state[reference][key])


def test_bf16_moments_are_the_fp32_update_rounded_to_nearest():
    """From the same state, a step with bf16 moments moves the params exactly as one with fp32 moments (the
    update computes in fp32) and keeps those moments rounded to nearest even."""
    low, exact = _params(), _params()
    low_optimizer = torch.optim.AdamW(_groups(low), lr=1e-3)
    exact_optimizer = torch.optim.AdamW(_groups(exact), lr=1e-3)
    for step in range(3):
        for param, twin in zip(low, exact):
            param.grad = torch.randn_like(param)
            twin.grad = param.grad.clone()
            if step:
                exact_optimizer.state[twin] = {key: value.float().clone()
                                               for key, value in low_optimizer.state[param].items()}
        adamw_step(low_optimizer, BF16, BF16)
        adamw_step(exact_optimizer, FP32, FP32)
        for param, twin in zip(low, exact):
            assert torch.equal(param, twin)
            for key in ("exp_avg", "exp_avg_sq"):
                kept = low_optimizer.state[param][key]
                assert kept.dtype == BF16 and torch.equal(kept, exact_optimizer.state[twin][key].bfloat16())


VALID = dict(lr=1e-3, use_distributed_optimizer=True, use_precision_aware_optimizer=True)
BF16_MOMENTS = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")


def test_tiny_gpt_trains_with_bf16_moments_like_with_fp32_moments(single_rank):  # noqa: F811
    """10 steps of a 2-layer GPT (bf16 params, distributed optimizer, lr 1e-2 with warm-up and cosine decay):
    the losses with bf16 moments stay within 3e-4 relative of those with fp32 moments (measured: at most
    3.0e-5; one bf16 rounding is up to 3.9e-3 relative), and differ from them (the moments are rounded)."""
    losses, moments = {}, {}
    for name, flags in (("fp32", ()), ("bf16", BF16_MOMENTS)):
        args = make_args("--bf16", "--use-distributed-optimizer", *flags)
        model, optimizer, scheduler = build_run(args, seed=1234)
        losses[name] = train_steps(model, optimizer, scheduler, args, 0, 10)
        moments[name] = {optimizer.optimizer.state[shard][key].dtype
                         for shard in optimizer.main_shards for key in ("exp_avg", "exp_avg_sq")}
    assert moments == {"fp32": {FP32}, "bf16": {BF16}}
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=3e-4)
    assert losses["bf16"] != losses["fp32"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_distributed_optimizer_steps_bf16_moments_in_the_triton_kernel_like_the_reference():
    """On a GPU the distributed optimizer's step is the Triton kernel (fusions/fused_adamw.py) with bf16 moments.
    Each step, from the optimizer's own state, the reference step on the same gradients gives the same fp32 main
    params (within fp32 rounding) and the same bf16 moments (both round to nearest even: each within one bf16
    ulp, at least 99% of all of them bit for bit, as in test_fused_adamw.py; fma contraction in the kernel moves
    a few); the model params are the main params rounded."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
        model = model.cuda().bfloat16()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        ddp = DistributedDataParallel(SimpleNamespace(calculate_per_token_loss=False), ddp_config, model)
        config = OptimizerConfig(**VALID, bf16=True, weight_decay=0.0, clip_grad=0.0, exp_avg_dtype=BF16,
                                 exp_avg_sq_dtype=BF16)
        optimizer = get_megatron_optimizer(config, [ddp])
        masters = [torch.zeros(param.numel(), device="cuda") for param in model.parameters()]
        reference = torch.optim.AdamW(masters, lr=config.lr, weight_decay=0.0)
        equal = total = 0
        for step in range(3):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            generator = torch.Generator(device="cuda").manual_seed(step)
            inputs = torch.randn(16, 32, device="cuda", generator=generator).bfloat16()
            ddp(inputs).float().square().mean().backward()
            finalize_model_grads([ddp])
            for param, master in zip(model.parameters(), masters):
                main = optimizer.main_param_and_state(param)["param"]
                master.copy_(main)
                master.grad = param.main_grad.detach().view(-1).clone()
                if step:
                    reference.state[master] = {key: value.clone() for key, value in optimizer.state[main].items()}
            assert optimizer.step()[0]
            adamw_step(reference, BF16, BF16)
            for param, master in zip(model.parameters(), masters):
                tensors = optimizer.main_param_and_state(param)
                torch.testing.assert_close(tensors["param"], master, rtol=1e-5, atol=1e-6)
                assert torch.equal(param.detach().view(-1), tensors["param"].bfloat16())
                for key in ("exp_avg", "exp_avg_sq"):
                    kept, expected = tensors[key], reference.state[master][key]
                    assert kept.dtype == expected.dtype == BF16
                    torch.testing.assert_close(kept.float(), expected.float(), rtol=2**-7, atol=0)  # one bf16 ulp
                    equal += int((kept == expected).sum())
                    total += kept.numel()
        assert optimizer._fused()
        assert equal >= 0.99 * total, f"{equal} of {total} moments bit for bit"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()



@pytest.mark.parametrize("settings, message", [
    (dict(VALID, use_distributed_optimizer=False),
     r"only supported with the distributed optimizer \(--use-distributed-optimizer\)"),
    (dict(VALID, optimizer="sgd"), r"only supported with adam, got optimizer 'sgd' \(--optimizer sgd\)"),
    (dict(VALID, exp_avg_dtype=torch.float16), r"exp_avg_dtype \(--exp-avg-dtype fp16\) is not supported yet; "
                                                r"use fp32 or bf16"),
    (dict(VALID, exp_avg_sq_dtype=torch.uint8), r"exp_avg_sq_dtype \(--exp-avg-sq-dtype fp8\) is not supported yet"),
    (dict(VALID, main_grads_dtype=BF16, bf16=False), r"main_grads_dtype \(--main-grads-dtype bf16\) needs --bf16"),
    (dict(VALID, main_params_dtype=torch.float16), r"main_params_dtype \(--main-params-dtype fp16\) is not "
                                                   r"supported yet; use fp32"),
    (dict(lr=1e-3, exp_avg_dtype=BF16), r"exp_avg_dtype \(--exp-avg-dtype bf16\) can only be fp32 when not using "
                                        r"the precision-aware optimizer \(--use-precision-aware-optimizer\)"),
])
def test_optimizer_config_refuses_what_megatron_refuses_and_what_is_not_built(settings, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**settings)


def test_optimizer_config_accepts_each_moment_in_fp32_or_bf16():
    for exp_avg_dtype in (FP32, BF16):
        for exp_avg_sq_dtype in (FP32, BF16):
            OptimizerConfig(**VALID, exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
