"""linear_with_grad_accumulation: the weight and bias gradients land in DDP's main_grad, fp32 or bf16 (summed
over backward passes, written over whatever an emptied buffer held) and nowhere else; the input gradient is
autograd's. Reference: float64 sums."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.fusions.fused_weight_gradient import linear_with_grad_accumulation
from tests.unit_tests.distributed.conftest import single_rank_groups  # noqa: F401 (the one-rank gloo fixture)


class TwoLinears(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 32).to(dtype), torch.nn.Linear(32, 4).to(dtype)

    def forward(self, x):
        hidden = torch.relu(linear_with_grad_accumulation(x, self.fc1.weight, self.fc1.bias))
        return linear_with_grad_accumulation(hidden, self.fc2.weight, self.fc2.bias)


def _reference_grads(model, inputs, upstream):
    """float64 gradients of sum_k <model(x_k), g_k> over the passes."""
    reference = TwoLinears(torch.float64)
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    for x, g in zip(inputs, upstream):
        hidden = torch.relu(F.linear(x.double(), reference.fc1.weight, reference.fc1.bias))
        F.linear(hidden, reference.fc2.weight, reference.fc2.bias).backward(g.double())
    return {name: param.grad for name, param in reference.named_parameters()}


def _run(device, grad_dtype):
    model = TwoLinears(torch.bfloat16).to(device)
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_dtype == torch.float32)
    ddp = DistributedDataParallel(SimpleNamespace(calculate_per_token_loss=False), config, model)
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        ddp.zero_grad_buffer()
        if step:  # an emptied buffer's bytes are never read (the first writer writes): NaN changes nothing
            ddp.buffers[0].grad_data.fill_(float("nan"))
        inputs = [torch.randn(3, 5, 8, generator=generator).bfloat16().to(device) for _ in range(2)]
        upstream = [torch.randn(3, 5, 4, generator=generator).bfloat16().to(device) for _ in range(2)]
        for x, g in zip(inputs, upstream):  # two microbatches accumulate
            ddp(x).backward(g)
        ddp.finish_grad_sync()
        expected = _reference_grads(model, [x.cpu() for x in inputs], [g.cpu() for g in upstream])
        for name, param in model.named_parameters():
            assert param.grad is None and param.main_grad.dtype == grad_dtype
            torch.testing.assert_close(param.main_grad.cpu().double(), expected[name], atol=3e-2, rtol=2e-2)
        assert all(param.grad_added_to_main_grad for param in model.parameters())


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradients_accumulate_in_main_grad_on_cpu(single_rank_groups, grad_dtype):
    _run("cpu", grad_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradients_accumulate_in_main_grad_on_gpu(single_rank_groups, grad_dtype):
    _run("cuda", grad_dtype)


def test_plain_linear_without_main_grad():
    weight = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    linear_with_grad_accumulation(x, weight, None).sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones(2, 4, dtype=torch.bfloat16).t() @ x)


def test_bias_without_main_grad_gets_autograds_gradient():
    """A bias with no fp32 main_grad beside a weight with one gets autograd's column sums, unmarked."""
    weight = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    weight.main_grad = torch.zeros(4, 8)
    x, g = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.bfloat16)
    linear_with_grad_accumulation(x, weight, bias).backward(g)
    torch.testing.assert_close(bias.grad, g.sum(dim=0))
    torch.testing.assert_close(weight.main_grad, g.float().t() @ x.float())
    assert weight.grad_added_to_main_grad and not hasattr(bias, "grad_added_to_main_grad")
