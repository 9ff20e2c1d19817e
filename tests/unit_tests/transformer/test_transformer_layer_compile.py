"""`use_torch_compile`: a compiled transformer layer computes what the eager one does (outputs and
gradients). CPU: the dynamo graph through AOT autograd without code generation (`aot_eager`), which is
where capture goes wrong if it does; GPU: the Inductor kernels that training runs, bf16 tolerance."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

GPT_SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                 bias_activation_fusion=True, bias_dropout_fusion=True, use_torch_compile=True)
LLAMA_SHAPE = dict(GPT_SHAPE, num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
                   activation_func=F.silu, add_bias_linear=False, ffn_hidden_size=48)


def _layer_outputs_and_grads(layer, forward, x, rotary):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    output, _ = forward(x, None, rotary, None, None, None)
    output.backward(torch.cos(output.detach()))  # a non-uniform upstream gradient
    return [output.detach(), x.grad] + [param.grad for param in layer.parameters()]


@pytest.mark.parametrize("shape", [GPT_SHAPE, LLAMA_SHAPE], ids=["gpt", "llama"])
def test_compiled_layer_graph_equals_eager_on_cpu(shape):
    torch.manual_seed(0)
    config = TransformerConfig(**shape)
    layer = build_module(get_gpt_layer_local_spec(normalization=config.normalization), config=config).train()
    rotary = None
    if shape is LLAMA_SHAPE:
        rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, use_cpu_initialization=True)(8)
    x = torch.randn(8, 2, 32)
    eager = _layer_outputs_and_grads(layer, layer._forward, x, rotary)
    compiled = _layer_outputs_and_grads(layer, torch.compile(layer._forward, backend="aot_eager"), x, rotary)
    for ours, expected in zip(compiled, eager):
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def _gpt(use_torch_compile, **shape):
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(**dict(shape, use_torch_compile=use_torch_compile, bf16=True,
                                      params_dtype=torch.bfloat16))
    position = "rope" if config.normalization == "RMSNorm" else "learned_absolute"
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    return GPTModel(config, spec, 256, 64, position_embedding_type=position).cuda().train()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [GPT_SHAPE, LLAMA_SHAPE], ids=["gpt", "llama"])
def test_compiled_gpt_training_step_equals_eager_on_gpu(shape):
    shape = dict(shape, hidden_size=256, num_attention_heads=8)
    shape.pop("use_torch_compile")
    if "ffn_hidden_size" in shape:
        shape["ffn_hidden_size"] = 512
    eager, compiled = _gpt(False, **shape), _gpt(True, **shape)
    compiled.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 256, (2, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for model in (eager, compiled):
        positions = torch.arange(64, device="cuda").expand(2, 64)
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        results.append([loss.detach().float()] + [param.grad.float() for param in model.parameters()])
    for ours, expected in zip(results[1], results[0]):
        torch.testing.assert_close(ours, expected, atol=3e-2, rtol=3e-2)
