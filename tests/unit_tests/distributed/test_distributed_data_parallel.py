"""DistributedDataParallel: data-parallel training equals one process on the concatenated batch."""

import copy
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed

MODEL_CONFIG = SimpleNamespace(calculate_per_token_loss=False)


class MLP(torch.nn.Module):
    """8 -> hidden -> LayerNorm -> ReLU -> 4."""

    def __init__(self, seed=0, dtype=torch.float32, hidden=16):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)
        self.to(dtype)

    def forward(self, x):
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def batch(step, rows=8):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)


def test_buckets_cover_every_param_once_in_reverse_order(single_rank_groups):
    model = MLP()
    ddp_config = DistributedDataParallelConfig(bucket_size=40, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(MODEL_CONFIG, ddp_config, model)
    [buffer] = ddp.buffers
    sizes = [[param.numel() for param in bucket.params_list] for bucket in buffer.buckets]
    # Reverse order fc2.bias, fc2.weight | norm.bias, norm.weight, fc1.bias | fc1.weight, cut at >= 40.
    assert sizes == [[4, 64], [16, 16, 16], [128]]
    params_in_buckets = [param for bucket in buffer.buckets for param in bucket.params_list]
    assert sorted(map(id, params_in_buckets)) == sorted(map(id, model.parameters()))
    assert params_in_buckets[0] is model.fc2.bias and params_in_buckets[-1] is model.fc1.weight
    offset = 0
    for bucket in buffer.buckets:
        assert bucket.offset == offset and bucket.grad_data.data_ptr() == buffer.grad_data[offset:].data_ptr()
        for param in bucket.params_list:
            start, end = bucket.param_to_index[param]
            assert param.main_grad.data_ptr() == bucket.grad_data[start:end].data_ptr()
        offset += bucket.grad_data.numel()
    assert offset == buffer.grad_data.numel() == sum(param.numel() for param in model.parameters())
    # Without overlap the reduction waits for backward anyway: one bucket, --ddp-bucket-size ignored (Megatron).
    for config in (DistributedDataParallelConfig(), DistributedDataParallelConfig(bucket_size=40)):
        assert len(DistributedDataParallel(MODEL_CONFIG, config, MLP()).buffers[0].buckets) == 1


def test_backward_accumulates_into_main_grad_and_frees_grad(single_rank_groups):
    model, reference = MLP(dtype=torch.bfloat16), MLP(dtype=torch.bfloat16)
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    assert ddp.buffers[0].grad_data.dtype == torch.float32
    for step in range(2):
        x, y = batch(step)
        torch.nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
        torch.nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()).backward()
    for param, reference_param in zip(model.parameters(), reference.parameters()):
        assert param.grad is None and param.main_grad.dtype == torch.float32
        torch.testing.assert_close(param.main_grad, reference_param.grad.float(), rtol=2e-2, atol=2e-2)
    # Emptied, not zeroed: the next step's first gradient is written over whatever the buffer holds, and
    # a param that gets none is zeroed when its bucket is reduced.
    ddp.zero_grad_buffer()
    assert all(param.overwrite_main_grad for param in model.parameters())
    ddp.buffers[0].grad_data.fill_(float("nan"))
    model.fc1.requires_grad_(False)
    reference.zero_grad()
    x, y = batch(2)
    torch.nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
    torch.nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()).backward()
    ddp.finish_grad_sync()
    for name, param in model.named_parameters():
        expected = torch.zeros_like(param.main_grad) if name.startswith("fc1") else reference.get_parameter(name).grad
        torch.testing.assert_close(param.main_grad, expected.float(), rtol=2e-2, atol=2e-2, msg=name)
    # A reader before the reduction (the bad-step check) has the unwritten ones zeroed first.
    ddp.zero_grad_buffer()
    ddp.buffers[0].grad_data.fill_(float("nan"))
    torch.nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
    ddp.zero_unwritten_grads()
    assert all(torch.isfinite(buffer).all() for buffer in ddp.main_grad_buffers())


def test_a_backward_that_raises_leaves_nothing_held(single_rank_groups):
    """The 1-D params' gradients (biases, norm weights) go into main_grad together when backward ends; a backward
    that raises before its end never gets there, and the next step (after zero_grad_buffer) still gets exactly its
    own gradients."""
    model, reference = MLP(dtype=torch.bfloat16), MLP(dtype=torch.bfloat16)
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    x, y = batch(0)

    def fail(grad):
        raise RuntimeError("interrupted")

    hidden = torch.relu(model.fc1(x.bfloat16()))
    hidden.register_hook(fail)  # runs after fc2's and the norm's gradients were taken
    with pytest.raises(RuntimeError, match="interrupted"):
        torch.nn.functional.mse_loss(model.fc2(model.norm(hidden)), y.bfloat16()).backward()
    ddp.zero_grad_buffer()
    ddp.buffers[0].grad_data.fill_(float("nan"))
    torch.nn.functional.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
    torch.nn.functional.mse_loss(reference(x.bfloat16()), y.bfloat16()).backward()
    ddp.finish_grad_sync()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.main_grad, reference.get_parameter(name).grad.float(), rtol=2e-2, atol=2e-2,
                                   msg=name)


def test_a_dropped_wrapper_is_freed_and_its_hooks_then_say_so(single_rank_groups):
    """The parameters' hooks hold DDP weakly: dropping the wrapper frees it (and the process groups it holds)
    without waiting for interpreter teardown; a backward through the bare module afterwards is an error that
    names the cause, not a silent skip of the main_grad accumulation."""
    model = MLP()
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(), model)
    x, y = batch(0)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    wrapper = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert wrapper() is None
    with pytest.raises(RuntimeError, match="DistributedDataParallel wrapper was freed"):
        torch.nn.functional.mse_loss(model(x), y).backward()


def test_grad_aliasing_main_grad_is_not_added_twice(single_rank_groups):
    model, reference = MLP(), MLP()
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(), model)
    x, y = batch(0)
    for param in model.parameters():
        param.grad = param.main_grad  # what FP32Optimizer leaves behind after its step
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for param, reference_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.main_grad, reference_param.grad)


def test_nan_check_names_the_bucket_params(single_rank_groups):
    model = MLP()
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(check_for_nan_in_grad=True), model)
    model.fc1.bias.main_grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="rank 0: found nan .*fc1.bias"):
        ddp.finish_grad_sync()


def test_state_dict_is_the_bare_module_and_bad_configs_fail(single_rank_groups):
    model = MLP()
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(), model)
    assert list(ddp.state_dict()) == list(model.state_dict())
    with pytest.raises(ValueError, match="--calculate-per-token-loss"):
        DistributedDataParallel(SimpleNamespace(calculate_per_token_loss=True),
                                DistributedDataParallelConfig(average_in_collective=True), MLP())
    with pytest.raises(ValueError, match="overlap_param_gather .--overlap-param-gather. needs use_distributed_opt"):
        DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True)
    DistributedDataParallelConfig(align_param_gather=True)  # only acts with overlap_param_gather: accepted


def _gather(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return gathered


def _data_parallel_training(rank, world_size):
    parallel_state.initialize_model_parallel()
    model, reference = MLP(), MLP()
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(bucket_size=40), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.5), [ddp])
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    averaged = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(average_in_collective=True), MLP())

    for step in range(3):
        x, y = batch(step)
        local_x, local_y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        local_copy = copy.deepcopy(model)
        with ddp.no_sync():  # microbatch 1 of 2: nothing may be reduced yet
            (torch.nn.functional.mse_loss(ddp(local_x[:2]), local_y[:2]) / 2).backward()
            ddp.start_grad_sync()
        (torch.nn.functional.mse_loss(local_copy(local_x[:2]), local_y[:2]) / 2).backward()
        for param, local_param in zip(model.parameters(), local_copy.parameters()):
            assert torch.equal(param.main_grad, local_param.grad), "gradients were reduced inside no_sync"
        assert not torch.equal(*_gather(model.fc1.weight.main_grad))
        (torch.nn.functional.mse_loss(ddp(local_x[2:]), local_y[2:]) / 2).backward()
        finalize_model_grads([ddp])

        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        for param, reference_param in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.main_grad, reference_param.grad, rtol=1e-5, atol=1e-6)

        averaged.module.load_state_dict(model.state_dict())
        averaged.zero_grad_buffer()
        (torch.nn.functional.mse_loss(averaged(local_x), local_y)).backward()
        averaged.finish_grad_sync()
        for param, averaged_param in zip(model.parameters(), averaged.module.parameters()):
            torch.testing.assert_close(averaged_param.main_grad, param.main_grad, rtol=1e-5, atol=1e-6)

        assert optimizer.step()[0]
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_optimizer.step()
    for param, reference_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), reference_param.detach(), rtol=1e-5, atol=1e-5)


def _expert_params_and_broadcast(rank, world_size):
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)  # dp 2, expert dp 1
    model = MLP(seed=rank)
    model.fc2.weight.allreduce = False  # this rank's own expert
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(), model)
    assert [len(ddp.buffers), len(ddp.expert_parallel_buffers)] == [1, 1]
    expert_weight = model.fc2.weight.detach().clone()
    ddp.broadcast_params()
    assert torch.equal(model.fc2.weight, expert_weight), "an expert param must only sync within expert DP"
    for tensors in [_gather(param.detach()) for name, param in model.named_parameters() if name != "fc2.weight"]:
        assert torch.equal(tensors[0], tensors[1])

    for param in model.parameters():
        param.main_grad.fill_(float(rank + 1))
    ddp.finish_grad_sync()
    assert torch.all(model.fc1.weight.main_grad == 1.5)  # mean of 1 and 2 over data-parallel ranks
    assert torch.all(model.fc2.weight.main_grad == (rank + 1) / 2)  # scaled by 1/dp, reduced over edp = 1


def _data_parallel_checks(rank, world_size):
    _data_parallel_training(rank, world_size)
    _expert_params_and_broadcast(rank, world_size)


def test_data_parallel_equals_single_process_expert_params_and_broadcast():
    # One spawn for both checks: starting ranks costs seconds on a 2-core machine.
    run_distributed(_data_parallel_checks, 2)
