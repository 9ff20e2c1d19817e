"""tools/bench/reference_model.py is the yardstick of the throughput benchmark: it must have the shape of
our GPTModel for the same configuration (same parameter count, tied or untied, GQA, SwiGLU, RMSNorm,
RoPE, no biases) and train (the loss falls on a repeated batch)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
from reference_model import ReferenceConfig, build_reference, reference_train_step  # noqa: E402

GPT = (ReferenceConfig(2, 32, 4, 128, 96, 16),
       dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128), "learned_absolute", True)
LLAMA = (ReferenceConfig(2, 32, 4, 48, 96, 16, num_query_groups=2, swiglu=True, rmsnorm=True, rope=True,
                         bias=False, tied_embeddings=False),
         dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, num_query_groups=2,
              gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False),
         "rope", False)


@pytest.mark.parametrize("case", [GPT, LLAMA], ids=["gpt", "llama"])
def test_same_parameter_count_as_our_model(case):
    reference_config, ours, position, tied = case
    config = TransformerConfig(**ours, use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), 96, 16,
                     position_embedding_type=position, share_embeddings_and_output_weights=tied)
    reference, _ = build_reference(reference_config, torch.device("cpu"), compile_model=False)
    assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for p in model.parameters())


def test_reference_trains():
    torch.manual_seed(0)
    model, optimizer = build_reference(LLAMA[0], torch.device("cpu"), compile_model=False)
    optimizer.param_groups[0]["lr"] = 1e-2
    tokens = torch.randint(0, 96, (2, 17))
    first = reference_train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], device_type="cpu")
    for _ in range(20):
        last = reference_train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], device_type="cpu")
    assert last < first - 1.0
