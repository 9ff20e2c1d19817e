"""Gradient reduction over NCCL on two GPUs: the 1/dp scaling folded into the collective (a premultiplied sum
of fp32 gradients) gives the mean gradient, for DDP's all-reduce, the distributed optimizer's reduce-scatter,
the average in the collective, and the sharded gradients of --use-megatron-fsdp optim_grads over two
microbatches (fp32, and bf16 where the scaling stays a multiplication)."""

from contextlib import nullcontext

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp.sharded_grads import ShardedGradDataParallel
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.test_distributed_data_parallel import MODEL_CONFIG, MLP, batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

LAYOUTS = {
    "all-reduce": (DistributedDataParallel, dict(overlap_grad_reduce=True)),
    "reduce-scatter": (DistributedDataParallel, dict(overlap_grad_reduce=True, use_distributed_optimizer=True)),
    "average in the collective": (DistributedDataParallel, dict(average_in_collective=True)),
    "optim_grads": (ShardedGradDataParallel, dict(overlap_grad_reduce=True, use_distributed_optimizer=True)),
    "optim_grads, bf16": (ShardedGradDataParallel, dict(overlap_grad_reduce=True, use_distributed_optimizer=True)),
}


def _reduced_pieces(ddp, sharded: bool) -> dict:
    """{param: (this rank's reduced gradient values, their range in the flattened param)}."""
    if not sharded:
        return {param: (param.main_grad.flatten(), (0, param.numel())) for param in ddp.module.parameters()}
    [buffer] = ddp.buffers
    return {param: (ddp.reduced_grad(param) if isinstance(ddp, ShardedGradDataParallel)
                    else bucket.grad_shard[local[0]:local[1]], in_param)
            for param, (bucket, local, in_param) in buffer.owned_pieces().items()}


def _mean_gradient_of_each_layout(rank, world_size):
    parallel_state.initialize_model_parallel()
    x, y = (tensor.cuda() for tensor in batch(0, rows=8))
    references = {dtype: MLP(dtype=dtype).cuda() for dtype in (torch.float32, torch.bfloat16)}
    for dtype, reference in references.items():
        torch.nn.functional.mse_loss(reference(x.to(dtype)), y.to(dtype)).backward()
    for name, (wrapper, options) in LAYOUTS.items():
        dtype = torch.bfloat16 if "bf16" in name else torch.float32  # bf16 params: a bf16 gradient reduction
        reference, tolerance = references[dtype], dict(rtol=2e-2, atol=1e-2) if "bf16" in name else {}
        config = DistributedDataParallelConfig(bucket_size=40, **options)
        ddp = wrapper(MODEL_CONFIG, config, MLP(dtype=dtype).cuda())
        buckets = [bucket for buffer in ddp.buffers for bucket in buffer.buckets]
        folded = dtype == torch.float32 and not config.average_in_collective  # bucket docstring: fp32 only
        assert all(bucket.scales_in_collective == folded for bucket in buckets), name
        ddp.zero_grad_buffer()
        local_x, local_y = x[4 * rank: 4 * rank + 4].to(dtype), y[4 * rank: 4 * rank + 4].to(dtype)
        for half in (slice(0, 2), slice(2, 4)):  # two microbatches, the last one reduced
            with ddp.no_sync() if half.start == 0 else nullcontext():
                (torch.nn.functional.mse_loss(ddp(local_x[half]), local_y[half]) / 2).backward()
        ddp.finish_grad_sync()
        pieces = _reduced_pieces(ddp, config.use_distributed_optimizer)
        assert pieces, name
        for param, reference_param in zip(ddp.module.parameters(), reference.parameters()):
            if param in pieces:
                values, (start, end) = pieces[param]
                torch.testing.assert_close(values.float(), reference_param.grad.flatten()[start:end].float(),
                                           **(tolerance or dict(rtol=1e-5, atol=1e-6)),
                                           msg=lambda message: f"{name}: {message}")


def test_the_scaling_in_the_collective_gives_the_mean_gradient():
    run_distributed(_mean_gradient_of_each_layout, 2, backend="nccl")
