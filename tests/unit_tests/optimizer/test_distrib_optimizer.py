"""The distributed optimizer on two gloo ranks against the plain Megatron optimizer and plain torch (one
process, AdamW, twice the microbatches), its deferred parameter all-gather, and its state round trip; on the
same ranks, the parameter norm of --log-params-norm and the replica check of
--check-weight-hash-across-dp-replicas-interval."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.training.weight_hash import check_weight_hashes_across_dp_replicas
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.test_distributed_data_parallel import MLP

MODEL_CONFIG = SimpleNamespace(calculate_per_token_loss=False)
ROWS, MICROBATCHES = 4, 2  # per rank and step


def mlp(dtype=torch.float32, seed=0):
    """1412 params, pieces of 100 elements that straddle the two ranks' shards."""
    return MLP(seed, dtype, hidden=100)


def global_batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(2 * ROWS, 8, generator=generator), torch.randn(2 * ROWS, 4, generator=generator)


def build(dtype, clip_grad, seed=0, distributed=True, **ddp_kwargs):
    model = mlp(dtype, seed)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True,
                                               **ddp_kwargs)
    ddp = DistributedDataParallel(MODEL_CONFIG, ddp_config, model)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip_grad, bf16=dtype == torch.bfloat16,
                             use_distributed_optimizer=distributed)
    return ddp, get_megatron_optimizer(config, [ddp])


def train(ddp, optimizer, steps, first_step=0):
    """Each rank takes its half of the global batch in MICROBATCHES microbatches, as pretrain() does."""
    rank, dtype = dist.get_rank(), next(ddp.parameters()).dtype
    for step in range(first_step, first_step + steps):
        x, y = (tensor[ROWS * rank : ROWS * (rank + 1)].to(dtype) for tensor in global_batch(step))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for index, (x_mb, y_mb) in enumerate(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))):
            loss = torch.nn.functional.mse_loss(ddp(x_mb).float(), y_mb.float()) / MICROBATCHES
            if index < MICROBATCHES - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        finalize_model_grads([ddp])
        assert optimizer.step()[0]


def params(ddp):
    ddp.start_param_sync(force_sync=True)
    return [param.detach().clone() for param in ddp.module.parameters()]


def torch_reference(steps, clip_grad):
    """One process, plain AdamW, the global batch in 2 x MICROBATCHES microbatches. (Without an LR scheduler
    to apply the groups' wd_mult, every Megatron param group decays with weight_decay.)"""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = global_batch(step)
        for x_mb, y_mb in zip(x.chunk(2 * MICROBATCHES), y.chunk(2 * MICROBATCHES)):
            (torch.nn.functional.mse_loss(model(x_mb), y_mb) / (2 * MICROBATCHES)).backward()
        if clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
    return [param.detach() for param in model.parameters()]


def check_equals_plain_optimizer_and_torch():
    for dtype in (torch.float32, torch.bfloat16):
        plain = build(dtype, clip_grad=0.0, distributed=False)
        train(*plain, steps=3)
        overlapped = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300)
        for variant in ({}, overlapped, dict(overlapped, average_in_collective=True)):
            sharded = build(dtype, 0.0, **variant)
            assert isinstance(sharded[1], DistributedOptimizer)
            train(*sharded, steps=3)
            # Without clipping Adam works element by element: sharding changes no bit (and halving is exact).
            for got, expected in zip(params(sharded[0]), params(plain[0])):
                assert torch.equal(got, expected), (dtype, variant)
    # With clipping the global norm is summed in another order (1e-7 relative), so allow that.
    sharded, plain = build(torch.float32, 1.0, overlap_grad_reduce=True), build(torch.float32, 1.0, distributed=False)
    train(*sharded, steps=3)
    train(*plain, steps=3)
    reference = torch_reference(3, clip_grad=1.0)
    for got, expected, independent in zip(params(sharded[0]), params(plain[0]), reference):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got, independent, rtol=1e-5, atol=1e-6)


def check_param_gather_waits_for_the_next_forward():
    overlapped = build(torch.float32, 0.0, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300)
    eager = build(torch.float32, 0.0, overlap_grad_reduce=True, bucket_size=300)
    launched = []
    for bucket in overlapped[0].buffers[0].buckets:
        def start(async_op, bucket=bucket, original=bucket.start_param_gather):
            launched.append((bucket.bucket_id, async_op))
            original(async_op)
        bucket.start_param_gather = start
    train(*overlapped, steps=2)
    train(*eager, steps=2)
    [buffer] = overlapped[0].buffers
    # After each step every bucket's gather is launched, in the order forward needs them (the last bucket holds
    # the first params), and left in flight for the forward's pre-hooks.
    in_forward_order = [(bucket.bucket_id, True) for bucket in reversed(buffer.buckets)]
    assert len(in_forward_order) > 1 and launched == in_forward_order * 2
    assert all(bucket.param_gather_handle is not None for bucket in buffer.buckets)
    overlapped[0](torch.zeros(1, 8))  # the pre-hooks wait bucket by bucket
    assert not any(bucket.param_gather_handle is not None for bucket in buffer.buckets)
    for got, expected in zip(overlapped[0].module.parameters(), eager[0].module.parameters()):
        assert torch.equal(got, expected)


def check_state_round_trip():
    """bf16: the gathered state, scattered into a fresh optimizer (other init), continues bit for bit."""
    kwargs = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300)
    ddp, optimizer = build(torch.bfloat16, 1.0, **kwargs)
    train(ddp, optimizer, steps=2)
    model_state = {name: tensor.clone() for name, tensor in params_state(ddp).items()}
    optimizer_state, gathered = optimizer.state_dict(), optimizer.get_parameter_state_dp_zero()
    assert (gathered is None) == (dist.get_rank() != 0)
    assert [group["step"] for group in optimizer_state["optimizer"]["param_groups"]] == [2, 2]

    fresh_ddp, fresh_optimizer = build(torch.bfloat16, 1.0, seed=5, **kwargs)
    fresh_ddp.load_state_dict(model_state)
    fresh_optimizer.load_state_dict(optimizer_state)
    fresh_optimizer.load_parameter_state_from_dp_zero(gathered)
    train(ddp, optimizer, steps=2, first_step=2)
    train(fresh_ddp, fresh_optimizer, steps=2, first_step=2)
    for got, expected in zip(params(fresh_ddp), params(ddp)):
        assert torch.equal(got, expected)
    for got, expected in zip(fresh_optimizer.main_shards, optimizer.main_shards):
        assert torch.equal(got, expected)


def params_state(ddp):
    ddp.start_param_sync(force_sync=True)
    return ddp.state_dict()


def check_gathered_layout_and_other_data_parallel_size():
    """fp32: the gathered main params sit at Megatron's offsets; the state scatters onto DP = 1 and back."""
    ddp, optimizer = build(torch.float32, 1.0)
    plain_ddp, plain_optimizer = build(torch.float32, 1.0, distributed=False)
    train(ddp, optimizer, steps=2)
    train(plain_ddp, plain_optimizer, steps=2)
    gathered = optimizer.get_parameter_state_dp_zero()
    [buffer] = ddp.buffers
    if dist.get_rank() == 0:
        state = gathered[0][(torch.float32, torch.float32)]
        assert state["numel_unpadded"] == buffer.numel_unpadded == state["param"].numel()
        plain_state = plain_optimizer.optimizer.state
        for param, plain_param in zip(ddp.module.parameters(), plain_ddp.module.parameters()):
            start, end, _ = buffer.param_index_map[param]  # one bucket: no padding removed before it
            assert torch.equal(state["param"][start:end], param.detach().view(-1))
            torch.testing.assert_close(state["exp_avg"][start:end], plain_state[plain_param]["exp_avg"].view(-1))
            torch.testing.assert_close(state["exp_avg_sq"][start:end],
                                       plain_state[plain_param]["exp_avg_sq"].view(-1))

    broadcast = [gathered]
    dist.broadcast_object_list(broadcast, src=0)
    optimizer_state = optimizer.state_dict()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # DP = 1: one rank owns everything
    single_ddp, single_optimizer = build(torch.float32, 1.0, seed=3)
    single_optimizer.load_state_dict(optimizer_state)
    single_optimizer.load_parameter_state_from_dp_zero(broadcast[0])
    regathered = single_optimizer.get_parameter_state_dp_zero()[0][(torch.float32, torch.float32)]
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(regathered[key], broadcast[0][0][(torch.float32, torch.float32)][key])

    truncated = {0: {key: {**value, "param": value["param"][:10]} for key, value in broadcast[0][0].items()}}
    with pytest.raises(ValueError, match="buffer 0 .* holds 10 elements, this run's has"):
        single_optimizer.load_parameter_state_from_dp_zero(truncated)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()


def check_setup_errors_and_fp16_overflow():
    with pytest.raises(ValueError, match="needs every model chunk wrapped in DistributedDataParallel"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [mlp()])
    ddp, _ = build(torch.float32, 1.0)
    with pytest.raises(ValueError, match="set OptimizerConfig.use_distributed_optimizer too"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0), [ddp])
    with pytest.raises(ValueError, match="supports --optimizer adam only"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, optimizer="sgd", use_distributed_optimizer=True), [ddp])
    plain_ddp, plain_optimizer = build(torch.float32, 1.0, distributed=False)
    _, optimizer = build(torch.float32, 1.0)
    with pytest.raises(ValueError, match="saved without the distributed optimizer"):
        optimizer.load_state_dict({"optimizer": plain_optimizer.state_dict()})
    with pytest.raises(ValueError, match="saved with the distributed optimizer"):
        plain_optimizer.load_state_dict(optimizer.state_dict())

    model = mlp(torch.float16)
    ddp = DistributedDataParallel(MODEL_CONFIG, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    config = OptimizerConfig(lr=1.0, fp16=True, initial_loss_scale=8.0, hysteresis=1, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, [ddp])
    for param in model.parameters():
        param.main_grad.fill_(1.0)
    if dist.get_rank() == 1:  # a value only rank 1's shard holds
        model.fc1.weight.main_grad.view(-1)[0] = float("inf")
    assert optimizer.step() == (False, None, None), "every rank must skip the step"
    assert optimizer.get_loss_scale().item() == 4.0


def check_params_norm():
    """--log-params-norm: the norm of the fp32 main params, each counted once over the ranks; the sharded
    optimizer's equals the plain one's and that of the gathered parameters."""
    sharded, plain = build(torch.bfloat16, 1.0), build(torch.bfloat16, 1.0, distributed=False)
    train(*sharded, steps=2)
    train(*plain, steps=2)
    main_params = torch.cat([param.view(-1) for param in plain[1].get_parameters()])
    assert main_params.dtype == torch.float32
    assert plain[1].get_params_norm() == pytest.approx(main_params.norm().item(), rel=1e-6)
    assert sharded[1].get_params_norm() == pytest.approx(plain[1].get_params_norm(), rel=1e-6)


def check_weight_hashes_across_replicas():
    """--check-weight-hash-across-dp-replicas-interval: equal replicas pass (the sharded optimizer's deferred
    all-gather is completed first); one changed weight on rank 1 stops both ranks, naming it and the rank."""
    ddp, optimizer = build(torch.bfloat16, 1.0, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300)
    train(ddp, optimizer, steps=1)
    check_weight_hashes_across_dp_replicas([ddp], iteration=1)
    if dist.get_rank() == 1:
        with torch.no_grad():
            ddp.module.fc2.bias[2] += 1.0
    with pytest.raises(RuntimeError) as error:
        check_weight_hashes_across_dp_replicas([ddp], iteration=2)
    assert str(error.value) == ("--check-weight-hash-across-dp-replicas-interval: at iteration 2 the data-parallel "
                                "replicas hold different weights:\n  - chunk 0 module.fc2.bias: global ranks [1] "
                                "differ from rank 0")


def _distributed_optimizer_checks(rank, world_size):
    parallel_state.initialize_model_parallel()
    check_params_norm()
    check_weight_hashes_across_replicas()
    check_equals_plain_optimizer_and_torch()
    check_param_gather_waits_for_the_next_forward()
    check_state_round_trip()
    check_gathered_layout_and_other_data_parallel_size()
    check_setup_errors_and_fp16_overflow()


def test_distributed_optimizer_on_two_ranks():
    run_distributed(_distributed_optimizer_checks, 2)
