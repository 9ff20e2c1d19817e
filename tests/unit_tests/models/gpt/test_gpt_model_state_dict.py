"""State-dict keys and shapes of GPTModel (reference 8.4) and the per-group QKV row layout."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

H, NP, NG, HN, FFN, V, MAX_POS = 64, 4, 2, 16, 160, 96, 32


def _layer_keys(i: int, qkv_rows: int, fc1_rows: int, biases: bool, norm_bias: bool) -> dict:
    prefix = f"decoder.layers.{i}."
    keys = {
        "input_layernorm.weight": (H,),
        "self_attention.linear_qkv.weight": (qkv_rows, H),
        "self_attention.linear_proj.weight": (H, NP * HN),
        "pre_mlp_layernorm.weight": (H,),
        "mlp.linear_fc1.weight": (fc1_rows, H),
        "mlp.linear_fc2.weight": (H, FFN),
    }
    if norm_bias:
        keys.update({"input_layernorm.bias": (H,), "pre_mlp_layernorm.bias": (H,)})
    if biases:
        keys.update(
            {
                "self_attention.linear_qkv.bias": (qkv_rows,),
                "self_attention.linear_proj.bias": (H,),
                "mlp.linear_fc1.bias": (fc1_rows,),
                "mlp.linear_fc2.bias": (H,),
            }
        )
    return {prefix + key: shape for key, shape in keys.items()}


def _shapes(model) -> dict:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def test_gpt2_shaped_model_keys_and_shapes():
    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=NP, ffn_hidden_size=FFN)
    model = GPTModel(config, get_gpt_layer_local_spec(), V, MAX_POS, share_embeddings_and_output_weights=True)
    expected = {
        "embedding.word_embeddings.weight": (V, H),
        "embedding.position_embeddings.weight": (MAX_POS, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.final_layernorm.bias": (H,),
    }
    for i in range(2):
        # MHA: [np * (1 + 2) * hn, h]; tied, so no output_layer.weight on this (embedding) stage.
        expected.update(_layer_keys(i, NP * 3 * HN, FFN, biases=True, norm_bias=True))
    assert _shapes(model) == expected


def test_llama_shaped_model_keys_and_shapes():
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=NP, num_query_groups=NG, ffn_hidden_size=FFN,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), V, MAX_POS, position_embedding_type="rope")
    expected = {
        "embedding.word_embeddings.weight": (V, H),
        "decoder.final_layernorm.weight": (H,),
        "output_layer.weight": (V, H),
    }
    for i in range(2):
        # GQA: [ng * (np/ng + 2) * hn, h]; SwiGLU fc1 [2f, h]; RMSNorm and no linear biases.
        expected.update(_layer_keys(i, NG * (NP // NG + 2) * HN, 2 * FFN, biases=False, norm_bias=False))
    assert _shapes(model) == expected


def test_qkv_bias_only_and_qk_layernorm_keys():
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=NP, num_query_groups=NG, add_bias_linear=False,
        add_qkv_bias=True, qk_layernorm=True, normalization="RMSNorm",
    )
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True), V, MAX_POS, position_embedding_type="rope")
    shapes = _shapes(model)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.bias"] == (NG * (NP // NG + 2) * HN,)
    assert shapes["decoder.layers.0.self_attention.q_layernorm.weight"] == (HN,)
    assert shapes["decoder.layers.0.self_attention.k_layernorm.weight"] == (HN,)
    assert not [key for key in shapes if key.endswith(".bias") and "linear_qkv" not in key]


@pytest.mark.parametrize("num_query_groups", [4, 2, 1])
def test_qkv_rows_are_grouped_per_query_group(num_query_groups):
    """Rows for group g: its np/ng query heads, then its key head, then its value head (hn rows each)."""
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=NP, num_query_groups=num_query_groups,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
    )
    attention = GPTModel(config, get_gpt_layer_local_spec(), V, MAX_POS).decoder.layers[0].self_attention
    generator = torch.Generator().manual_seed(0)
    w_q = torch.randn(NP * HN, H, generator=generator)
    w_k = torch.randn(num_query_groups * HN, H, generator=generator)
    w_v = torch.randn(num_query_groups * HN, H, generator=generator)
    heads_per_group = NP // num_query_groups
    rows = []
    for group in range(num_query_groups):
        for head in range(group * heads_per_group, (group + 1) * heads_per_group):
            rows.append(w_q[head * HN : (head + 1) * HN])
        rows.append(w_k[group * HN : (group + 1) * HN])
        rows.append(w_v[group * HN : (group + 1) * HN])
    with torch.no_grad():
        attention.linear_qkv.weight.copy_(torch.cat(rows))

    x = torch.randn(5, 2, H, generator=generator)  # [s, b, h]
    query, key, value = attention.get_query_key_value_tensors(x)
    assert query.shape == (5, 2, NP, HN) and key.shape == value.shape == (5, 2, num_query_groups, HN)
    torch.testing.assert_close(query, (x @ w_q.t()).view(5, 2, NP, HN))
    torch.testing.assert_close(key, (x @ w_k.t()).view(5, 2, num_query_groups, HN))
    torch.testing.assert_close(value, (x @ w_v.t()).view(5, 2, num_query_groups, HN))
