"""Weights stored in FP8 (`fp8_param`, `--fp8-param-gather`) in a GPTModel trained through Megatron-Core's path.

- The FP8 GEMMs' weights are one byte per element, in a uint8 param buffer of their own under the distributed
  optimizer; dtype casts of the model leave the bytes alone; state dicts hold their value in bf16.
- References: the same model with bf16 weights. Training with FP8 weights gives bitwise its losses and main
  params (the casts give the bytes its forward quantizes, with the same scales), for both recipes and both
  mixed-precision optimizers.
- DP=2 (2 gloo ranks, distributed optimizer, overlapped grad reduce and param gather over several buckets)
  against DP=1: the all-gathers of the FP8 weights move uint8 bytes (one per element), and the losses are
  bitwise DP=1's. That takes a per-token loss (as Megatron-LM's Llama-3 FP8 example trains): with a per-
  microbatch mean DP=1 halves its output gradients (2 microbatches), which the first step's FP8 scale of 1
  rounds differently in E5M2 (2.5e-3 relative by the third loss, with bf16 weights alike).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed import param_and_grad_bucket
from megatron.core.fp8.params import dequantize_fp8_param, is_fp8_param
from megatron.core.fp8.quantize import exact_reciprocal, quantize_rounded, saturating_cast, scale_from_amax
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from tests.unit_tests.distributed.conftest import single_rank_groups  # noqa: F401 (the one-rank gloo fixture)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.fp8.test_fp8_model import MICRO_BATCH, MICROBATCHES, SEQ, _forward_step, _microbatches, _model

STEPS = 3
TENSORWISE = dict(fp8_recipe="tensorwise", fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
FP8_WEIGHTS = {f"decoder.layers.{layer}.{name}.weight" for layer in (0, 1)
               for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                            "mlp.linear_fc2")}


def _train(module, distributed: bool = True, bucket_size=None, dp: int = 1):
    """(summed losses per step over the data-parallel ranks, DDP wrapper, optimizer) after STEPS steps with
    AdamW; rank r of DP=dp takes microbatches r, r + dp, ... of each step's MICROBATCHES."""
    fp8_param = module.config.fp8_param
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, overlap_grad_reduce=distributed,
        overlap_param_gather=distributed, bucket_size=bucket_size, fp8_param_gather=fp8_param)
    model = DistributedDataParallel(module.config, ddp_config, module)
    module.config.finalize_model_grads_func, module.config.no_sync_func = finalize_model_grads, model.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=distributed),
                                       [model])
    rank = dist.get_rank()
    batches = _microbatches(STEPS)[rank::dp]
    data, losses = iter(batches), []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=data, model=[model],
                                              num_microbatches=MICROBATCHES // dp, seq_length=SEQ,
                                              micro_batch_size=MICRO_BATCH)
        optimizer.step()
        loss = torch.stack([report["lm loss"] for report in reports]).sum()
        if dp > 1:
            dist.all_reduce(loss)
        losses.append(loss.item())
    return losses, model, optimizer


def _main_params(optimizer) -> list:
    return [param.detach().clone() for param in optimizer.get_parameters()]


def test_weights_are_stored_one_byte_each_in_a_uint8_buffer(single_rank_groups):  # noqa: F811
    inner = _model(fp8_param=True, params_dtype=torch.float32)
    module = Float16Module(inner.config, inner)  # casts the model to bf16: not the FP8 bytes, their dtype
    fp8 = {name for name, param in module.named_parameters() if param.dtype == torch.float8_e4m3fn}
    assert {name.removeprefix("module.") for name in fp8} == FP8_WEIGHTS
    bf16 = _model()
    bytes_of = lambda model: sum(param.numel() * param.element_size() for param in model.parameters())  # noqa: E731
    fp8_numel = sum(param.numel() for name, param in bf16.named_parameters() if name in FP8_WEIGHTS)
    assert bytes_of(module) == bytes_of(bf16) - fp8_numel

    state = module.state_dict()
    for name, param in module.module.named_parameters():
        if name in FP8_WEIGHTS:
            assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], dequantize_fp8_param(param))
            assert module.state_dict(keep_vars=True)[name] is param
    before = {name: param.detach().clone() for name, param in module.named_parameters()}
    module.load_state_dict(state)  # the bf16 values cast back with the same scales: the same bytes
    assert all(torch.equal(param.view(torch.uint8), before[name].view(torch.uint8))
               for name, param in module.named_parameters() if name.removeprefix("module.") in FP8_WEIGHTS)

    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=True), module)
    fp8_buffer, = [buffer for buffer in model.buffers if buffer.param_dtype == torch.uint8]
    assert fp8_buffer.param_data.element_size() == 1 and fp8_buffer.grad_dtype == torch.bfloat16
    assert {model.param_to_name[param].removeprefix("module.") for param in fp8_buffer.params} == FP8_WEIGHTS
    start = fp8_buffer.param_data.data_ptr()
    assert all(start <= param.data_ptr() < start + fp8_buffer.param_data.numel() for param in fp8_buffer.params)


@pytest.mark.parametrize("recipe, distributed", [({}, True), (TENSORWISE, False)],
                         ids=["delayed-distributed_optimizer", "tensorwise-float16_optimizer"])
def test_training_is_bitwise_that_of_bf16_weights(single_rank_groups, recipe, distributed):  # noqa: F811
    bf16_losses, _, bf16_optimizer = _train(_model(**recipe), distributed)
    fp8_losses, model, fp8_optimizer = _train(_model(fp8_param=True, **recipe), distributed)
    assert fp8_losses == bf16_losses
    for fp8_main, bf16_main in zip(_main_params(fp8_optimizer), _main_params(bf16_optimizer)):
        assert torch.equal(fp8_main, bf16_main)
    assert sum(is_fp8_param(param) for param in model.parameters()) == len(FP8_WEIGHTS)


def test_fp8_weights_need_their_flags_and_ddp(single_rank_groups):  # noqa: F811
    with pytest.raises(ValueError, match="fp8_param must be used together with fp8 mode"):
        _model(fp8=None, fp8_param=True)
    module = _model(fp8_param=True)
    with pytest.raises(ValueError, match=r"wrap it with DistributedDataParallelConfig\(fp8_param_gather=True\)"):
        DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    tokens, labels = _microbatches(1)[0]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    with pytest.raises(ValueError, match="main_grad buffer of DistributedDataParallel: wrap the model in it"):
        module(tokens, positions, None, labels=labels).float().sum().backward()
    with torch.no_grad():  # inference needs no DDP
        assert torch.isfinite(module(tokens, positions, None, labels=labels)).all()


def _data_parallel_rank(rank, world_size, bucket_size):
    parallel_state.initialize_model_parallel()
    gathers = []
    gather = param_and_grad_bucket._all_gather_into_tensor

    def recorded(output, input, **kwargs):
        gathers.append((output.dtype, output.numel() * output.element_size()))
        return gather(output, input, **kwargs)

    param_and_grad_bucket._all_gather_into_tensor = recorded
    losses, _, _ = _train(_model(fp8_param=True, calculate_per_token_loss=True), bucket_size=bucket_size,
                          dp=world_size)
    return losses, gathers


def test_data_parallel_fp8_weights_gather_bytes_and_match_one_rank(single_rank_groups):  # noqa: F811
    module = _model(fp8_param=True, calculate_per_token_loss=True)
    bucket_size = module.decoder.layers[0].mlp.linear_fc1.weight.numel()  # several buckets per buffer
    losses, model, _ = _train(module, bucket_size=bucket_size)
    fp8_buffer, = [buffer for buffer in model.buffers if buffer.param_dtype == torch.uint8]
    assert len(fp8_buffer.buckets) > 1
    for rank_losses, gathers in run_distributed(_data_parallel_rank, 2, bucket_size):
        assert rank_losses == losses
        fp8_gathers = [size for dtype, size in gathers if dtype == torch.uint8]
        # Each bucket of the FP8 buffer is gathered after every step (for the next forward), one byte per element.
        assert sum(fp8_gathers) == STEPS * fp8_buffer.param_data.numel()
        assert {dtype for dtype, _ in gathers} == {torch.uint8, torch.bfloat16}


def test_compiled_casts_and_scales_give_the_eager_bits():
    """On CUDA the optimizer's cast of main params and a bf16 weight's tensorwise cast run compiled, the FP8
    weights' scales eagerly; compiled (Inductor on the CPU here) each gives the eager bits: the cast of the
    bf16-rounded main params, and the scales and inverse scales, correctly rounded on both sides (Triton's fp32
    division is not, so they are computed in fp64). The GPU test checks the casts' bytes on the GPU."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1 << 16, generator=generator) * 0.02
    amaxes = torch.exp(torch.randn(1 << 12, generator=generator) * 5)
    scale = torch.tensor(448 / 0.1)
    got = torch.compile(saturating_cast)(values.to(torch.bfloat16), scale, torch.float8_e4m3fn)
    expected = quantize_rounded(values, scale, torch.float8_e4m3fn, torch.bfloat16)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    scales = scale_from_amax(amaxes, 448.0, 0, torch.ones_like(amaxes))
    exact = torch.tensor([448.0 / amax for amax in amaxes.tolist()]).float()  # IEEE double quotients, rounded once
    assert torch.equal(scales, exact)
    assert torch.equal(torch.compile(scale_from_amax)(amaxes, 448.0, 0, torch.ones_like(amaxes)), scales)
    assert torch.equal(torch.compile(exact_reciprocal)(scales), scales.reciprocal())
