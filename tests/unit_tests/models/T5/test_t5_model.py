"""T5Model: Megatron-Core's state-dict keys, and logits/losses against a plain-torch T5 written from the
architecture (pre-norm layers, learned positions, cross-attention, tied output with bias)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions.transformer_engine import is_transformer_engine_available
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_decoder_with_transformer_engine_block_spec,
    get_t5_encoder_with_local_block_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN, HEADS, VOCAB, MAX_POSITIONS = 32, 4, 96, 24
ENC_LAYERS, DEC_LAYERS, BATCH, ENC_LEN, DEC_LEN = 2, 3, 2, 12, 7


def build_t5(**config_overrides) -> T5Model:
    torch.manual_seed(5)
    settings = dict(num_layers=DEC_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
    settings.update(config_overrides)
    config = TransformerConfig(**settings)
    encoder_config = copy.deepcopy(config)
    encoder_config.num_layers = ENC_LAYERS
    model = T5Model(
        config, encoder_config, get_t5_encoder_with_local_block_spec(ENC_LAYERS),
        get_t5_decoder_with_local_block_spec(DEC_LAYERS), VOCAB, MAX_POSITIONS,
        share_embeddings_and_output_weights=True,
    )
    with torch.no_grad():  # non-trivial norms and biases, so that every weight matters
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def megatron_t5_keys() -> set:
    """Megatron-Core T5 (local spec) parameter names, written out from its layer specs."""
    attention = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    mlp = ["mlp.linear_fc1", "mlp.linear_fc2"]
    cross = ["cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.linear_proj"]
    keys = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "position_embeddings.weight",
            "lm_head.output_layer.bias", "output_layer.bias"}
    for block, layers, linears, norms in (
        ("encoder", ENC_LAYERS, attention + mlp, ["input_layernorm", "pre_mlp_layernorm"]),
        ("decoder", DEC_LAYERS, attention + cross + mlp, ["input_layernorm", "pre_cross_attn_layernorm",
                                                          "pre_mlp_layernorm"]),
    ):
        for i in range(layers):
            for name in linears + norms:
                keys |= {f"{block}.layers.{i}.{name}.weight", f"{block}.layers.{i}.{name}.bias"}
        keys |= {f"{block}.final_layernorm.weight", f"{block}.final_layernorm.bias"}
    return keys


def test_state_dict_keys_are_megatron_cores():
    state = build_t5().state_dict()
    assert set(state) == megatron_t5_keys()
    assert state["decoder.layers.0.cross_attention.linear_kv.weight"].shape == (2 * HIDDEN, HIDDEN)
    assert state["decoder.layers.0.cross_attention.linear_q.weight"].shape == (HIDDEN, HIDDEN)
    # The aliases are the same tensors, as in Megatron-Core.
    assert state["output_layer.bias"].data_ptr() == state["lm_head.output_layer.bias"].data_ptr()
    assert state["position_embeddings.weight"].data_ptr() == state["embedding.position_embeddings.weight"].data_ptr()


def reference_t5(state: dict, encoder_ids, decoder_ids, encoder_padding):
    """Logits [b, sd, V] of the T5 described by `state`; encoder_padding bool [b, se] (True = padding)."""
    hn = HIDDEN // HEADS

    def embed(ids):
        positions = state["embedding.position_embeddings.weight"][: ids.size(1)]
        return (state["embedding.word_embeddings.weight"][ids] + positions).transpose(0, 1)  # [s, b, h]

    def norm(x, name):
        return F.layer_norm(x, (HIDDEN,), state[name + ".weight"], state[name + ".bias"], 1e-5)

    def linear(x, name):
        return x @ state[name + ".weight"].t() + state[name + ".bias"]

    def attend(q, k, v, hidden_keys):  # q [sq, b, np, hn], k/v [sk, b, np, hn], hidden_keys [b or 1, sq or 1, sk]
        scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / math.sqrt(hn)
        scores = scores.masked_fill(hidden_keys[:, None], float("-inf"))
        out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), v)
        return out.reshape(out.size(0), out.size(1), HIDDEN)

    def self_attention(x, name, hidden_keys):
        qkv = linear(x, name + ".linear_qkv").reshape(x.size(0), x.size(1), HEADS, 3, hn)  # per head q, k, v
        return linear(attend(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], hidden_keys), name + ".linear_proj")

    def cross_attention(x, context, name, hidden_keys):
        q = linear(x, name + ".linear_q").reshape(x.size(0), x.size(1), HEADS, hn)
        kv = linear(context, name + ".linear_kv").reshape(context.size(0), context.size(1), HEADS, 2, hn)
        return linear(attend(q, kv[..., 0, :], kv[..., 1, :], hidden_keys), name + ".linear_proj")

    def mlp(x, name):
        return linear(F.gelu(linear(x, name + ".linear_fc1")), name + ".linear_fc2")

    padding_keys = encoder_padding[:, None, :]
    x = embed(encoder_ids)
    for i in range(ENC_LAYERS):
        layer = f"encoder.layers.{i}."
        x = x + self_attention(norm(x, layer + "input_layernorm"), layer + "self_attention", padding_keys)
        x = x + mlp(norm(x, layer + "pre_mlp_layernorm"), layer + "mlp")
    context = norm(x, "encoder.final_layernorm")

    future = torch.ones(DEC_LEN, DEC_LEN, dtype=torch.bool).triu(1)[None]
    y = embed(decoder_ids)
    for i in range(DEC_LAYERS):
        layer = f"decoder.layers.{i}."
        y = y + self_attention(norm(y, layer + "input_layernorm"), layer + "self_attention", future)
        y = y + cross_attention(norm(y, layer + "pre_cross_attn_layernorm"), context, layer + "cross_attention",
                                padding_keys)
        y = y + mlp(norm(y, layer + "pre_mlp_layernorm"), layer + "mlp")
    y = norm(y, "decoder.final_layernorm")
    logits = y @ state["embedding.word_embeddings.weight"].t() + state["lm_head.output_layer.bias"]
    return logits.transpose(0, 1)


def _inputs():
    generator = torch.Generator().manual_seed(1)
    encoder_ids = torch.randint(0, VOCAB, (BATCH, ENC_LEN), generator=generator)
    decoder_ids = torch.randint(0, VOCAB, (BATCH, DEC_LEN), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, DEC_LEN), generator=generator)
    encoder_padding = torch.zeros(BATCH, ENC_LEN, dtype=torch.bool)
    encoder_padding[1, 8:] = True
    return encoder_ids, decoder_ids, labels, encoder_padding


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_logits_and_losses_match_a_plain_torch_t5(backend):
    model = build_t5(attention_backend=backend).eval()
    encoder_ids, decoder_ids, labels, encoder_padding = _inputs()
    mask = encoder_padding[:, None, None, :]
    with torch.no_grad():
        logits = model(encoder_ids, decoder_ids, mask, None, mask)
        losses = model(encoder_ids, decoder_ids, mask, None, mask, lm_labels=labels)
    state = {name: value.detach() for name, value in model.state_dict().items()}
    expected = reference_t5(state, encoder_ids, decoder_ids, encoder_padding)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    expected_losses = F.cross_entropy(expected.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(losses, expected_losses.reshape(BATCH, DEC_LEN), atol=2e-5, rtol=1e-5)


def test_padding_and_future_tokens_do_not_leak_and_every_weight_learns():
    model = build_t5()
    encoder_ids, decoder_ids, labels, encoder_padding = _inputs()
    mask = encoder_padding[:, None, None, :]
    losses = model(encoder_ids, decoder_ids, mask, None, mask, lm_labels=labels)
    changed_encoder, changed_decoder = encoder_ids.clone(), decoder_ids.clone()
    changed_encoder[1, 8:] = (changed_encoder[1, 8:] + 1) % VOCAB  # other padding tokens
    changed_decoder[:, 4:] = (changed_decoder[:, 4:] + 1) % VOCAB  # other future decoder tokens
    with torch.no_grad():
        again = model(changed_encoder, changed_decoder, mask, None, mask, lm_labels=labels)
    torch.testing.assert_close(again[:, :4], losses[:, :4].detach(), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(again[:, 4:], losses[:, 4:].detach())

    losses.sum().backward()
    without_grad = [name for name, param in model.named_parameters() if param.grad is None or not param.grad.any()]
    assert without_grad == []


def test_encoder_only_output_and_unsupported_options():
    model = build_t5().eval()
    encoder_ids, decoder_ids, _, encoder_padding = _inputs()
    mask = encoder_padding[:, None, None, :]
    with torch.no_grad():
        context = model(encoder_ids, decoder_ids, mask, None, mask, output_encoder_hidden_only=True)
        from_context = model(None, decoder_ids, None, None, mask, encoder_hidden_states=context)
        full = model(encoder_ids, decoder_ids, mask, None, mask)
    assert context.shape == (ENC_LEN, BATCH, HIDDEN)
    torch.testing.assert_close(from_context, full)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS)
    for position_type in ("relative", "rope"):
        with pytest.raises(ValueError, match=f"position_embedding_type '{position_type}' is not supported yet"):
            T5Model(config, config, get_t5_encoder_with_local_block_spec(1), get_t5_decoder_with_local_block_spec(1),
                    VOCAB, MAX_POSITIONS, position_embedding_type=position_type)


def test_transformer_engine_specs_say_what_to_install():
    if is_transformer_engine_available():
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ImportError, match="needs NVIDIA Transformer Engine, which is not installed"):
        get_t5_decoder_with_transformer_engine_block_spec(2)
