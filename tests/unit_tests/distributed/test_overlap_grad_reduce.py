"""--overlap-grad-reduce: bucket reductions launched from the gradient hooks during the last microbatch's
backward give the same gradients as reducing after backward, bit for bit, and the mean gradient of a plain
torch model on the whole batch; earlier microbatches reduce nothing. Two gloo ranks."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from tests.unit_tests.dist_utils import run_distributed

MODEL_CONFIG = SimpleNamespace(calculate_per_token_loss=False)
NUM_MICROBATCHES = 3


class TiedMLP(torch.nn.Module):
    """x -> fc_in -> norm -> relu -> mid -> (fc_in.weight)^T: the input weight is used twice, as tied
    embeddings are. Buckets of 40 elements (reverse order): [mid.bias, mid.weight], [norm.bias,
    norm.weight, fc_in.bias], [fc_in.weight]."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.fc_in = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.mid = torch.nn.Linear(16, 16)
        self.to(dtype)
        self.hidden_hook = None

    def forward(self, x):
        hidden = self.fc_in(x)
        if self.hidden_hook is not None and hidden.requires_grad:
            hidden.register_hook(self.hidden_hook)
        return self.mid(torch.relu(self.norm(hidden))) @ self.fc_in.weight


def microbatch(rank, index, dtype):
    generator = torch.Generator().manual_seed(100 * rank + index)
    return torch.randn(4, 8, generator=generator).to(dtype), torch.randn(4, 8, generator=generator).to(dtype)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float()) / NUM_MICROBATCHES


def _gather(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return gathered


def reduced_grads(rank, dtype, **ddp_kwargs):
    """main_grad of every param after NUM_MICROBATCHES microbatches, the last one outside no_sync."""
    model = TiedMLP(dtype)
    ddp_config = DistributedDataParallelConfig(bucket_size=40, **ddp_kwargs)
    ddp = DistributedDataParallel(MODEL_CONFIG, ddp_config, model)
    [buffer] = ddp.buffers
    overlap = ddp_config.overlap_grad_reduce
    if overlap:
        assert [[ddp.param_to_name[p] for p in bucket.params_list] for bucket in buffer.buckets] == [
            ["mid.bias", "mid.weight"], ["norm.bias", "norm.weight", "fc_in.bias"], ["fc_in.weight"]]
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        for index in range(NUM_MICROBATCHES - 1):
            loss_of(ddp, *microbatch(rank, index, dtype)).backward()
    assert not any(bucket.grad_reduce_started for bucket in buffer.buckets), "reduced before the last microbatch"
    local = model.mid.weight.main_grad.clone()
    assert not torch.equal(*_gather(local)), "the accumulated gradients of the two ranks must still differ"

    started_mid_backward = []
    model.hidden_hook = lambda grad: started_mid_backward.append([b.grad_reduce_started for b in buffer.buckets])
    loss_of(ddp, *microbatch(rank, NUM_MICROBATCHES - 1, dtype)).backward()
    model.hidden_hook = None
    if overlap:
        # When backward reaches fc_in, the reduction of the layers above it is under way already.
        assert started_mid_backward == [[True, False, False]]
        assert all(bucket.grad_reduce_started for bucket in buffer.buckets)
    else:
        assert not any(bucket.grad_reduce_started for bucket in buffer.buckets)
    ddp.finish_grad_sync()
    return {name: param.main_grad.clone() for name, param in model.named_parameters()}


def reference_grads(dtype, world_size):
    """Plain torch: the fp32 model on every rank's microbatches, loss averaged over all of them."""
    model = TiedMLP(dtype).float()
    for rank in range(world_size):
        for index in range(NUM_MICROBATCHES):
            (loss_of(model, *microbatch(rank, index, torch.float32)) / world_size).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def _misuse(rank):
    ddp_config = DistributedDataParallelConfig(bucket_size=40, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(MODEL_CONFIG, ddp_config, TiedMLP(torch.float32))
    x, y = microbatch(rank, 0, torch.float32)
    loss_of(ddp, x, y).backward()
    try:
        loss_of(ddp, x, y).backward()
    except RuntimeError as error:
        assert "mid.bias received a second gradient" in str(error) and "no_sync()" in str(error)
    else:
        raise AssertionError("a second backward outside no_sync must be refused under overlap")
    ddp.zero_grad_buffer()  # waits for the reductions still in flight


def _overlap_checks(rank, world_size):
    parallel_state.initialize_model_parallel()
    variants = {
        "fp32": (torch.float32, {}),
        "bf16, fp32 grads": (torch.bfloat16, {"grad_reduce_in_fp32": True}),
        "bf16 grads (--grad-reduce-in-bf16)": (torch.bfloat16, {}),
        "--ddp-average-in-collective": (torch.float32, {"average_in_collective": True}),
    }
    for variant, (dtype, kwargs) in variants.items():
        overlapped = reduced_grads(rank, dtype, overlap_grad_reduce=True, **kwargs)
        after_backward = reduced_grads(rank, dtype, overlap_grad_reduce=False, **kwargs)
        reference = reference_grads(dtype, world_size)
        for name, grad in overlapped.items():
            assert torch.equal(grad, after_backward[name]), f"{variant}: {name} differs with overlap"
            assert grad.dtype == (torch.bfloat16 if variant.startswith("bf16 grads") else torch.float32)
            tolerance = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(grad.float(), reference[name], rtol=tolerance, atol=tolerance, msg=variant)
    _misuse(rank)


def test_overlapped_reduction_equals_reduction_after_backward():
    run_distributed(_overlap_checks, 2)
