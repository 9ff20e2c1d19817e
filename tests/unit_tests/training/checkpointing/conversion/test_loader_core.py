"""The core loader refuses what it cannot read, by the checkpoint's parameter names."""

import pytest

from megatron.training.checkpointing.conversion.loader_core import _check_model_type


def test_transformer_engine_names_are_refused_local_names_pass():
    local = {"decoder.layers.0.input_layernorm.weight": None, "decoder.layers.0.self_attention.linear_qkv.weight": None}
    _check_model_type(local, "GPT", "ckpt")  # also what --transformer-impl transformer_engine saves here
    te = {**local, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": None}
    with pytest.raises(ValueError, match=r"ckpt holds Transformer Engine parameter names \(decoder.layers.0."
                                         r"self_attention.linear_qkv.layer_norm_weight, ...: layer norms fused"):
        _check_model_type(te, "GPT", "ckpt")
