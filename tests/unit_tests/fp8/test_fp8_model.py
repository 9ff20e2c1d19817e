"""FP8 inside a GPTModel trained through Megatron-Core's path (DDP, the schedule, finalize_model_grads).

- Only the transformer layers' linears run in FP8 (not the embedding or the output layer), minus the
  first/last layers with first_last_layers_bf16.
- The schedule updates the scales once per step; activation recomputation (full, and selective of the MLP)
  gives bitwise the gradients and scaling state of the run without it (a recomputed forward quantizes with
  the same scales and records the same amaxes); the same for the bf16 GEMMs that accumulate into main_grad.
- TP=2 with sequence parallelism on 2 gloo ranks against TP=1: the scaling states are the same on both
  ranks and equal TP=1's, as the amax all-reduce over TP makes them the whole tensors' amaxes: the weight
  column exactly (the same weights); the input and output-gradient columns within 5e-2 (activations and
  gradients differ by the other reduction order, amplified by FP8 rounding layer after layer; measured
  <= 3.5% and <= 2%). Losses within 2e-3 relative. The QKV weight gradient within 15% (norm of the
  difference over the norm): the scales differ by those percents, so every E5M2 rounding differs and the
  two runs carry independent FP8 noise; this model's hybrid FP8 gradient is 9% off its bf16 one (measured
  7.6% between TP=2 and TP=1), a wrong layout would be off by ~100%.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.fp8 import Fp8Scaling
from megatron.core.fp8.scaling import GRAD_OUTPUT, INPUT, WEIGHT
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed.conftest import single_rank_groups  # noqa: F401 (the one-rank gloo fixture)
from tests.unit_tests.dist_utils import run_distributed

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES, STEPS = 128, 32, 2, 2, 3


def _model(tp: int = 1, sequence_parallel: bool = False, **overrides) -> GPTModel:
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    settings = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bf16=True,
        params_dtype=torch.bfloat16, fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, gradient_accumulation_fusion=True,
    )
    config = TransformerConfig(**{**settings, **overrides})
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _microbatches(steps: int = STEPS):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (steps * MICROBATCHES, MICRO_BATCH, SEQ + 1), generator=generator)
    return [(sequence[:, :-1], sequence[:, 1:]) for sequence in tokens]


def _forward_step(data_iterator, model):
    device = next(model.parameters()).device
    tokens, labels = (tensor.to(device) for tensor in next(data_iterator))
    positions = torch.arange(SEQ, device=device).expand(MICRO_BATCH, SEQ)
    losses = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss_sum = output.float().sum()
        return loss_sum, torch.tensor(output.numel(), dtype=torch.int), {"lm loss": loss_sum.detach()}

    return losses, loss_func


def _train(module: GPTModel, steps: int = STEPS):
    """(losses, main grads of the last step, scaling states) after `steps` steps without optimizer updates
    (the weights stay put, the scales move)."""
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    module.config.finalize_model_grads_func, module.config.no_sync_func = finalize_model_grads, model.no_sync
    data, losses = iter(_microbatches(steps)), []
    for _ in range(steps):
        model.zero_grad_buffer()
        reports = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=data, model=[model],
                                              num_microbatches=MICROBATCHES, seq_length=SEQ,
                                              micro_batch_size=MICRO_BATCH)
        losses.append(sum(report["lm loss"].item() for report in reports))
    grads = {name: param.main_grad.clone() for name, param in module.named_parameters()}
    states = {name: value.clone() for name, value in module.state_dict().items() if name.endswith("_extra_state")}
    return losses, grads, states


def _fp8_modules(model) -> list:
    return sorted(name.rsplit(".fp8", 1)[0] for name, module in model.named_modules() if isinstance(module, Fp8Scaling))


def test_only_the_transformer_layers_linears_run_in_fp8():
    linears = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    assert _fp8_modules(_model()) == sorted(f"decoder.layers.{layer}.{name}" for layer in (0, 1) for name in linears)
    model = _model(num_layers=4, first_last_layers_bf16=True)
    assert _fp8_modules(model) == sorted(f"decoder.layers.{layer}.{name}" for layer in (1, 2) for name in linears)
    assert model.output_layer.fp8 is None


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["mlp"]),
])
@pytest.mark.parametrize("fp8", ["hybrid", None])  # None: the bf16 GEMMs with main_grad accumulation
def test_recomputation_gives_the_same_gradients_and_scales(single_rank_groups, recompute, fp8):  # noqa: F811
    losses, grads, states = _train(_model(fp8=fp8))
    assert len(states) == (8 if fp8 else 0)
    assert all((state[0] != 1).all() for state in states.values())  # the schedule updated every scale
    assert all((state[1] == 0).all() and (state[-3:] > 0).all() for state in states.values())  # 3 steps of history
    recomputed_losses, recomputed_grads, recomputed_states = _train(_model(fp8=fp8, **recompute))
    assert recomputed_losses == losses
    for name in grads:
        assert torch.equal(recomputed_grads[name], grads[name]), name
    for name in states:
        assert torch.equal(recomputed_states[name], states[name]), name


def _tensor_parallel_rank(rank, world_size, reference_states):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    losses, grads, states = _train(_model(tp=2, sequence_parallel=True))
    group = parallel_state.get_tensor_model_parallel_group()
    for name, state in states.items():  # the same on both ranks
        other = [torch.empty_like(state) for _ in range(2)]
        dist.all_gather(other, state, group=group)
        assert torch.equal(other[0], other[1]), name
        expected = reference_states[name]
        assert torch.equal(state[:, WEIGHT], expected[:, WEIGHT]), name
        torch.testing.assert_close(state[:, INPUT], expected[:, INPUT], rtol=5e-2, atol=0, msg=f"{name} X")
        torch.testing.assert_close(state[:, GRAD_OUTPUT], expected[:, GRAD_OUTPUT], rtol=5e-2, atol=0, msg=f"{name} dY")
    qkv = grads["decoder.layers.0.self_attention.linear_qkv.weight"]
    shards = [torch.empty_like(qkv) for _ in range(2)]
    dist.all_gather(shards, qkv, group=group)
    return losses, torch.cat(shards)


def test_tensor_parallel_with_sequence_parallelism_matches_one_rank(single_rank_groups):  # noqa: F811
    losses, grads, states = _train(_model())
    # Each rank keeps the query groups it owns: rank r's qkv rows are group r's [q, q, k, v] rows.
    expected_qkv = grads["decoder.layers.0.self_attention.linear_qkv.weight"]
    for tp_losses, qkv in run_distributed(_tensor_parallel_rank, 2, states):
        assert tp_losses == pytest.approx(losses, rel=2e-3)
        assert ((qkv - expected_qkv).norm() / expected_qkv.norm()).item() < 0.15


def test_compiled_layer_runs_the_fp8_gemms_eagerly_between_its_graphs():
    """--use-torch-compile: dynamo breaks the layer's graph around each FP8 GEMM (torch.compiler.disable) and
    the rest is captured; on CPU through AOT autograd without code generation, bitwise what eager computes."""
    layer = _model(num_layers=1).decoder.layers[0].train()
    x = torch.randn(SEQ, MICRO_BATCH, 64, dtype=torch.bfloat16)
    results = []
    for forward in (layer._forward, torch.compile(layer._forward, backend="aot_eager")):
        inputs = x.clone().requires_grad_()
        output, _ = forward(inputs, None, None, None, None, None)
        output.backward(torch.cos(output.detach()))
        results.append([output, inputs.grad] + [param.grad for param in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    for compiled, eager in zip(*reversed(results)):
        assert torch.equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9+")
@pytest.mark.parametrize("use_torch_compile", [False, True])
def test_fp8_training_steps_on_the_gpu_track_bf16(single_rank_groups, use_torch_compile):  # noqa: F811
    """Three steps on the GPU, eager and with compiled layers: the losses within 2% of the same model's in
    bf16, every scale updated."""
    runs = [_train(_model(fp8=fp8, use_torch_compile=use_torch_compile).cuda()) for fp8 in (None, "hybrid")]
    (bf16_losses, _, _), (fp8_losses, grads, states) = runs
    assert fp8_losses == pytest.approx(bf16_losses, rel=2e-2)
    assert all(torch.isfinite(grad).all() for grad in grads.values())
    assert len(states) == 8 and all((state[0] != 1).all() for state in states.values())
