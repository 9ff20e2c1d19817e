"""muP (megatron/core/transformer/mup.py, megatron/core/optimizer/mup.py) against its formulas, on a tiny GPT of
width 64 scaled from a proxy of width 16 (m = 4): the init stds drawn, the attention scale, the embedding and
logit multipliers, and each param group's learning rates and Adam epsilon."""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, HIDDEN, BASE, LAYERS, STD = 512, 8, 64, 16, 2, 0.02
M = HIDDEN / BASE


def _config(**overrides):
    settings = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=STD, use_mup=True,
                    mup_base_hidden_size=BASE)
    return TransformerConfig(**{**settings, **overrides})


def _model(config, tied=False):
    torch.manual_seed(0)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=tied)


def test_derived_fields():
    config = _config()
    assert config.mup_width_mult == M
    assert config.softmax_scale == 1 / config.kv_channels  # 1/d instead of 1/sqrt(d)
    assert config.mup_output_mult == 1 / M
    assert _config(mup_base_head_dim=4.0).softmax_scale == math.sqrt(4.0) / config.kv_channels
    assert _config(mup_attn_scale_power=0.5).softmax_scale == 1 / math.sqrt(config.kv_channels)
    assert _config(mup_output_mult=0.5).mup_output_mult == 0.5
    assert _config(mup_base_hidden_size=None).mup_width_mult == 1.0
    with pytest.raises(ValueError, match=r"mup_base_hidden_size \(0\) must be positive"):
        _config(mup_base_hidden_size=0)


def test_init_stds():
    """Embeddings and the untied output layer N(0, sigma^2); hidden weights N(0, sigma^2 / m); the output
    projections N(0, sigma^2 / (2 L m)). Measured over >= 4096 draws each (standard error < 1.2%)."""
    model = _model(_config())
    layer = model.decoder.layers[0]
    expected = {
        "word embedding": (model.embedding.word_embeddings.weight, STD),
        "output layer": (model.output_layer.weight, STD),
        "linear_qkv": (layer.self_attention.linear_qkv.weight, STD / math.sqrt(M)),
        "linear_fc1": (layer.mlp.linear_fc1.weight, STD / math.sqrt(M)),
        "linear_proj": (layer.self_attention.linear_proj.weight, STD / math.sqrt(2 * LAYERS * M)),
        "linear_fc2": (layer.mlp.linear_fc2.weight, STD / math.sqrt(2 * LAYERS * M)),
    }
    for name, (weight, std) in expected.items():
        assert weight.std().item() == pytest.approx(std, rel=0.05), name
    assert model.embedding.word_embeddings.weight.is_embedding_parameter
    assert model.output_layer.weight.is_embedding_parameter
    assert model.decoder.layers[0].self_attention.core_attention.softmax_scale == 1 / 16


def test_embedding_and_logit_multipliers():
    """The embedding output times mup_embedding_mult, the logits times mup_output_mult (1/m): with both
    multipliers set to 1 the same weights give exactly embedding / 2 and logits * m (powers of two)."""
    config = _config(mup_embedding_mult=2.0)
    model = _model(config)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(2, SEQ)
    embedded, logits = model.embedding(tokens, positions), model(tokens, positions, None)
    config.mup_embedding_mult, config.mup_output_mult = 1.0, 1.0
    torch.testing.assert_close(embedded, model.embedding(tokens, positions) * 2.0, rtol=0, atol=0)
    config.mup_embedding_mult = 2.0
    torch.testing.assert_close(logits * M, model(tokens, positions, None), rtol=0, atol=0)


def _groups(optimizer_name, model, **config):
    optimizer_config = OptimizerConfig(optimizer=optimizer_name, lr=1e-3, min_lr=1e-5, adam_eps=1e-8, **config)
    optimizer = get_megatron_optimizer(optimizer_config, [model], mup_width_mult=M)
    names = {id(param): name for name, param in model.named_parameters()}
    return {names[id(param)]: group for group in optimizer.param_groups for param in group["params"]}


def test_adam_groups():
    """Adam: the weight matrices lr / m and eps / m (both ends of the schedule); embeddings, output layer,
    biases and norms keep lr and eps."""
    model = _model(_config())
    for name, group in _groups("adam", model).items():
        hidden = group["params"][0].dim() == 2 and "embedding" not in name and "output_layer" not in name
        factor = 1 / M if hidden else 1.0
        assert (group["max_lr"], group["min_lr"], group["eps"]) == pytest.approx(
            (1e-3 * factor, 1e-5 * factor, 1e-8 * factor)), name
        assert group["default_config"] is not hidden, name


def test_sgd_groups():
    """SGD: the vector-like params (embeddings, output layer, biases, norms) lr * m; the matrices keep lr."""
    model = _model(_config())
    for name, group in _groups("sgd", model).items():
        vector_like = group["params"][0].dim() <= 1 or "embedding" in name or "output_layer" in name
        factor = M if vector_like else 1.0
        assert (group["max_lr"], group["min_lr"]) == pytest.approx((1e-3 * factor, 1e-5 * factor)), name


def test_decoupled_lr_keeps_the_embedding_and_output_lr():
    model = _model(_config())
    groups = _groups("adam", model, decoupled_lr=5e-3)
    assert groups["embedding.word_embeddings.weight"]["max_lr"] == 5e-3
    assert groups["decoder.layers.0.mlp.linear_fc1.weight"]["max_lr"] == pytest.approx(1e-3 / M)
