"""Layer specs: building from a spec, and the Transformer Engine spec with and without TE installed."""

import logging
import sys
import types

import pytest
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.torch_norm import RMSNorm
from megatron.core.transformer.transformer_config import TransformerConfig


def test_transformer_engine_spec_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # makes `import transformer_engine` fail
    with pytest.raises(ImportError, match=r'pip install "megatron\[te\]"') as error:
        get_gpt_layer_with_transformer_engine_spec()
    assert "get_gpt_layer_local_spec()" in str(error.value)


def test_transformer_engine_spec_with_te_present_builds_the_local_layers(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    with caplog.at_level(logging.WARNING):
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    assert "pure PyTorch" in caplog.text
    assert spec == get_gpt_layer_local_spec(qk_layernorm=True)


def test_local_spec_rejects_features_that_do_not_exist_yet():
    with pytest.raises(ValueError, match="qk_l2_norm=True is not supported yet"):
        get_gpt_layer_local_spec(qk_l2_norm=True)


def test_decoder_block_spec_follows_moe_layer_freq():
    """--moe-layer-freq 2 on 4 layers: layers 0 and 2 are MoE; a 0/1 list is taken as written."""
    for freq, expected in ((2, [True, False, True, False]), ([0, 1, 1, 0], [False, True, True, False])):
        config = TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2, num_moe_experts=2,
                                   add_bias_linear=False, moe_layer_freq=freq)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        assert [spec.submodules.mlp.module is MoELayer for spec in block.layer_specs] == expected


def test_spec_normalization_wins_over_the_config():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    norm = build_module(spec.submodules.input_layernorm, config=config, hidden_size=8, eps=1e-5)
    assert isinstance(norm, RMSNorm)
