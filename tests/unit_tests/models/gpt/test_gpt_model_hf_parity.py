"""Logits parity of GPTModel with Hugging Face GPT2LMHeadModel and LlamaForCausalLM (same weights, fp32).

Tolerance: max |logit difference| < 1e-5 (observed 1e-6 to 2e-6 with |logits| up to ~3; the models
differ only in summation order). A wrong GELU variant moves the logits by ~8e-4, and dropping the
Llama-3.1 RoPE scaling by ~3e-2, so the tolerance separates right from wrong.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron.core.activations import openai_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt.hf_weight_maps import gpt2_to_megatron, llama_to_megatron

ATOL = 1e-5
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 96, 64, 2, 4, 24
# Larger than the usual 0.02 so that activations are O(1): a wrong GELU variant or RoPE scaling then
# moves the logits far outside the tolerance.
INIT_STD = 0.1


def _tokens(batch=2, seq=SEQ, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _megatron_logits(model, tokens, attention_mask=None):
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, attention_mask)


def _gpt2_pair(hf_activation: str, attention_backend: str = "auto", **config_overrides):
    torch.manual_seed(1)
    hf_config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        activation_function=hf_activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, initializer_range=INIT_STD,
    )
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, attention_backend=attention_backend, **config_overrides,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=32,
        share_embeddings_and_output_weights=True,
    ).eval()
    model.load_state_dict(gpt2_to_megatron(hf.state_dict(), LAYERS, HEADS), strict=True)
    return hf, model


@pytest.mark.parametrize(
    "hf_activation, attention_backend, config_overrides",
    [
        # Megatron's default --bias-gelu-fusion computes the tanh GELU = HF gelu_new.
        ("gelu_new", "auto", {"bias_activation_fusion": True}),
        ("gelu_new", "unfused", {"activation_func": openai_gelu}),
        ("gelu", "auto", {}),
    ],
)
def test_gpt2_logits_match_transformers(hf_activation, attention_backend, config_overrides):
    hf, model = _gpt2_pair(hf_activation, attention_backend, **config_overrides)
    tokens = _tokens()
    expected = hf(tokens).logits
    actual = _megatron_logits(model, tokens)
    assert actual.shape == expected.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def test_gpt2_explicit_causal_mask_equals_builtin_causal():
    _, model = _gpt2_pair("gelu_new", bias_activation_fusion=True)
    tokens = _tokens()
    causal_mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)  # True = masked
    torch.testing.assert_close(
        _megatron_logits(model, tokens, causal_mask), _megatron_logits(model, tokens), atol=ATOL, rtol=0
    )


def test_gpt2_loss_matches_shifted_cross_entropy():
    hf, model = _gpt2_pair("gelu_new", bias_activation_fusion=True)
    tokens = _tokens(seq=SEQ + 1)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand_as(inputs)
    with torch.no_grad():
        losses = model(inputs, positions, None, labels=labels)
        logits = hf(inputs).logits
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(2, SEQ)
    assert losses.shape == (2, SEQ) and losses.dtype == torch.float32
    torch.testing.assert_close(losses, expected, atol=ATOL, rtol=0)


def _llama_pair(rope_scaling: dict | None = None, rope_theta: float = 10000.0, attention_backend: str = "auto"):
    torch.manual_seed(2)
    groups, ffn = 2, 160
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=ffn, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=groups, max_position_embeddings=16384,
        rms_norm_eps=1e-5, rope_theta=rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attn_implementation="eager", initializer_range=INIT_STD,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=groups,
        ffn_hidden_size=ffn, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        attention_backend=attention_backend,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=64,
        share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=rope_theta,
        rope_scaling=rope_scaling is not None, rope_scaling_factor=(rope_scaling or {}).get("factor", 8.0),
    ).eval()
    model.load_state_dict(llama_to_megatron(hf.state_dict(), LAYERS, HEADS, groups), strict=True)
    return hf, model


@pytest.mark.parametrize("attention_backend", ["auto", "unfused"])
def test_llama_logits_match_transformers(attention_backend):
    hf, model = _llama_pair(attention_backend=attention_backend)
    tokens = _tokens()
    torch.testing.assert_close(_megatron_logits(model, tokens), hf(tokens).logits, atol=ATOL, rtol=0)


def test_llama31_rope_scaling_logits_match_transformers():
    rope_scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf, model = _llama_pair(rope_scaling=rope_scaling, rope_theta=500000.0)
    tokens = _tokens(seq=48)
    torch.testing.assert_close(_megatron_logits(model, tokens), hf(tokens).logits, atol=ATOL, rtol=0)
