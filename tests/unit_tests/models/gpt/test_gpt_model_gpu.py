"""GPTModel on a CUDA device: on-device init from the CUDA RNG streams, bf16 with SDPA kernels,
Float16Module, and recompute replaying CUDA dropout. Skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB, SEQ = 512, 256


def _model(**overrides):
    settings = dict(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    settings.update(overrides)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(**settings)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")


def _batch():
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def test_parameters_are_created_on_the_gpu_and_cpu_init_moves_there_unchanged():
    on_device = _model()
    assert {param.device.type for param in on_device.parameters()} == {"cuda"}
    torch.manual_seed(0)
    cpu_model = _model(use_cpu_initialization=True).eval()
    tokens, _ = _batch()
    with torch.no_grad():
        expected = cpu_model(tokens.cpu(), None, None)
        actual = cpu_model.cuda()(tokens, None, None)
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["flash", "fused", "auto"])
def test_bf16_sdpa_backends_agree_with_the_unfused_reference(backend):
    reference = _model(attention_backend="unfused", bf16=True).eval()
    wrapped_reference = Float16Module(reference.config, reference)
    model = _model(attention_backend=backend, bf16=True).eval()
    model.load_state_dict(reference.state_dict())
    wrapped = Float16Module(model.config, model)
    tokens, labels = _batch()
    with torch.no_grad():
        expected = wrapped_reference(tokens, None, None, labels=labels)
        losses = wrapped(tokens, None, None, labels=labels)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, expected, atol=2e-2, rtol=2e-2)


def test_recompute_replays_cuda_dropout():
    results = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                      dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])):
        torch.manual_seed(0)
        model = _model(use_cpu_initialization=True, hidden_dropout=0.1, attention_dropout=0.1, **recompute).cuda()
        tokens, labels = _batch()
        model_parallel_cuda_manual_seed(5)
        loss = model(tokens, None, None, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), model.decoder.layers[0].self_attention.linear_qkv.weight.grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-6)
