"""The CUDA path: fused AdamW under the bf16 wrapper, the loss scaler on the device, DDP over NCCL."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.timers import Timers, timed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).cuda()


def test_fused_adamw_on_bf16_params_equals_fused_adamw_on_the_fp32_master():
    """The bf16 wrapper's step (the Triton AdamW of fusions/fused_adamw.py, fp32 arithmetic) against torch's
    fused AdamW on fp32 masters: equal up to fp32 rounding; the model params are the masters rounded to bf16."""
    model = make_model().bfloat16()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, bf16=True, clip_grad=0.0), [model])
    assert optimizer.optimizer.defaults["fused"]
    masters = [param.detach().float().clone().requires_grad_() for param in model.parameters()]
    reference = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0, fused=True)
    for step in range(3):
        generator = torch.Generator(device="cuda").manual_seed(step)
        for param, master in zip(model.parameters(), masters):
            grad = torch.randn(param.shape, device="cuda", generator=generator)
            param.main_grad, master.grad = grad.clone(), grad.clone()
        assert optimizer.step()[0]
        reference.step()
    for param, master in zip(model.parameters(), masters):
        torch.testing.assert_close(param.main_param, master.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(param.detach(), param.main_param.bfloat16())


def test_fp16_loss_scaler_lives_on_the_device():
    model = make_model().half()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, fp16=True, hysteresis=1), [model])
    assert optimizer.get_loss_scale().is_cuda
    for param in model.parameters():
        param.grad = torch.full_like(param, float("inf"))
    assert optimizer.step() == (False, None, None)
    assert optimizer.get_loss_scale().item() == 2.0**31


def test_ddp_over_nccl_with_fp32_grad_buffers_and_timers():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model, reference = make_model().bfloat16(), make_model().bfloat16()
        timers = Timers(1, "minmax")
        ddp = DistributedDataParallel(
            type("Config", (), {"timers": timers})(), DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
        )
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [ddp])
        x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
        with timed(timers, "forward-backward"):
            ddp(x).float().square().mean().backward()
        reference(x).float().square().mean().backward()
        finalize_model_grads([ddp])
        for param, reference_param in zip(model.parameters(), reference.parameters()):
            assert param.grad is None and param.main_grad.dtype == torch.float32 and param.main_grad.is_cuda
            torch.testing.assert_close(param.main_grad, reference_param.grad.float(), rtol=2e-2, atol=2e-3)
        assert optimizer.step()[0]
        report = timers.get_all_timers_string(["forward-backward", "all-grads-sync"])
        assert "forward-backward" in report and "all-grads-sync" in report
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("distributed", [False, True])
def test_bf16_grad_buffers_reach_the_fused_adamw_as_they_are(distributed):
    """With bf16 grad buffers (--grad-reduce-in-bf16) the fused AdamW reads DDP's bf16 gradients themselves (no
    fp32 copy per param and step): the same step, bit for bit, and the same gradient norm (clipping on) as a
    model whose fp32 buffers hold those gradients widened."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        config = OptimizerConfig(lr=1e-2, bf16=True, clip_grad=1e-3, use_distributed_optimizer=distributed)
        runs = []
        for in_fp32 in (False, True):
            model = make_model().bfloat16()
            ddp = DistributedDataParallel(type("Config", (), {})(), DistributedDataParallelConfig(
                grad_reduce_in_fp32=in_fp32, use_distributed_optimizer=distributed), model)
            runs.append((ddp, get_megatron_optimizer(config, [ddp])))
        (bf16_ddp, bf16_optimizer), (fp32_ddp, fp32_optimizer) = runs
        x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
        for step in range(2):
            for ddp, _ in runs:
                ddp.zero_grad_buffer()
            bf16_ddp(x * (step + 1)).float().square().mean().backward()
            finalize_model_grads([bf16_ddp])
            for ours, theirs in zip(bf16_ddp.parameters(), fp32_ddp.parameters()):
                assert ours.main_grad.dtype == torch.bfloat16
                theirs.main_grad.copy_(ours.main_grad)
            results = [optimizer.step() for optimizer in (bf16_optimizer, fp32_optimizer)]
            assert results[0] == results[1] and results[0][0]
            grads = [shard.grad for group in bf16_optimizer.optimizer.param_groups for shard in group["params"]]
            assert grads and all(grad.dtype == torch.bfloat16 for grad in grads)
        for ours, theirs in zip(bf16_ddp.parameters(), fp32_ddp.parameters()):
            assert torch.equal(ours, theirs)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
