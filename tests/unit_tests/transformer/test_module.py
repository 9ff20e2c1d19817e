"""params_dtype at construction and Float16Module (half-precision model, fp32 at its edges)."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ = 64, 8


def _model(**config):
    # Weights are drawn from the model-parallel RNG stream when one is seeded (a test before this one in the
    # same process may have left one): start from none, so that two calls build the same weights.
    get_cuda_rng_tracker().reset()
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, **config
    )
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ).eval()


def _batch():
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def test_params_dtype_is_used_for_every_parameter():
    model = _model(params_dtype=torch.bfloat16, bf16=True)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}


def test_float16_module_runs_in_bf16_and_returns_fp32():
    reference = _model()
    wrapped = Float16Module(_model(bf16=True).config, _model())
    assert {param.dtype for param in wrapped.parameters()} == {torch.bfloat16}
    assert list(wrapped.state_dict()) == list(reference.state_dict())  # no "module." prefix
    tokens, positions = _batch()
    with torch.no_grad():
        logits = wrapped(tokens, positions, None)
        expected = reference(tokens, positions, None)
        # An fp32 decoder_input is cast to bf16 on the first stage (else the bf16 linears would reject it).
        embedded = reference.embedding(tokens, positions)
        from_embedding = wrapped(tokens, positions, None, decoder_input=embedded)
    assert logits.dtype == from_embedding.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)
    torch.testing.assert_close(from_embedding, logits, atol=0.02, rtol=0)


def test_float16_module_needs_a_half_precision_flag():
    model = _model()
    with pytest.raises(ValueError, match="exactly one of config.fp16 / config.bf16"):
        Float16Module(model.config, model)
