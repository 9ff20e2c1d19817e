"""BertModel: Megatron-Core's keys (reference 8.4), outputs and losses, the padding mask, sentence embeddings.
Logits parity with Hugging Face is in tests/unit_tests/training/checkpointing/conversion/test_bert_hf.py."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions.transformer_engine import is_transformer_engine_available
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import (
    bert_layer_local_spec,
    get_bert_layer_local_spec,
    get_bert_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, HIDDEN, SEQ, BATCH, LAYERS = 90, 32, 12, 3, 2


def build_bert(add_binary_head=True, tied=True, **config_overrides) -> BertModel:
    torch.manual_seed(3)
    settings = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                    hidden_dropout=0.0, attention_dropout=0.0)
    settings.update(config_overrides)
    return BertModel(
        TransformerConfig(**settings), num_tokentypes=2 if add_binary_head else 0,
        transformer_layer_spec=bert_layer_local_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        share_embeddings_and_output_weights=tied, add_binary_head=add_binary_head,
    )


def _inputs():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    padding_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding_mask[1, 7:] = 0
    padding_mask[2, 10:] = 0
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, 5:] = 1
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, padding_mask, types, labels


def test_state_dict_keys_are_megatron_cores():
    layer_keys = [f"{name}.{kind}" for name in ("input_layernorm", "self_attention.linear_qkv",
                                                "self_attention.linear_proj", "pre_mlp_layernorm", "mlp.linear_fc1",
                                                "mlp.linear_fc2") for kind in ("weight", "bias")]
    expected = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                "embedding.tokentype_embeddings.weight", "encoder.final_layernorm.weight",
                "encoder.final_layernorm.bias", "lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
                "output_layer.bias", "pooler.dense.weight", "pooler.dense.bias", "binary_head.weight",
                "binary_head.bias"}
    expected |= {f"encoder.layers.{i}.{key}" for i in range(LAYERS) for key in layer_keys}
    assert set(build_bert().state_dict()) == expected
    untied_no_head = set(build_bert(add_binary_head=False, tied=False).state_dict())
    assert untied_no_head == (expected | {"output_layer.weight"}) - {
        "embedding.tokentype_embeddings.weight", "pooler.dense.weight", "pooler.dense.bias", "binary_head.weight",
        "binary_head.bias"}
    assert bert_layer_local_spec.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.padding


def test_losses_are_the_cross_entropy_of_the_logits_and_the_binary_head_sees_cls():
    model = build_bert().eval()
    ids, padding_mask, types, labels = _inputs()
    labels[0, :3] = -1  # positions without a masked-LM label, as the dataset gives them
    with torch.no_grad():
        logits, binary_logits = model(ids, padding_mask, tokentype_ids=types)
        losses, binary_again = model(ids, padding_mask, tokentype_ids=types, lm_labels=labels)
    assert logits.shape == (BATCH, SEQ, VOCAB) and binary_logits.shape == (BATCH, 2)
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1).clamp(min=0), reduction="none")
    torch.testing.assert_close(losses[labels >= 0], expected.reshape(BATCH, SEQ)[labels >= 0])
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(binary_again, binary_logits)
    # The binary head reads the pooled first position only: [CLS] decides, later tokens only through attention.
    hidden = model.encoder(model.embedding(ids, model.bert_position_ids(ids), types),
                           model.bert_extended_attention_mask(padding_mask))
    pooled = torch.tanh(hidden[0] @ model.pooler.dense.weight.t() + model.pooler.dense.bias)
    torch.testing.assert_close(binary_logits, pooled @ model.binary_head.weight.t() + model.binary_head.bias)


def test_padding_tokens_change_nothing_and_no_row_is_nan():
    model = build_bert().eval()
    ids, padding_mask, types, _ = _inputs()
    other = ids.clone()
    other[padding_mask == 0] = (other[padding_mask == 0] + 7) % VOCAB
    with torch.no_grad():
        logits, binary = model(ids, padding_mask, tokentype_ids=types)
        other_logits, other_binary = model(other, padding_mask, tokentype_ids=types)
    real = padding_mask.bool()
    torch.testing.assert_close(other_logits[real], logits[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(other_binary, binary, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(logits).all()


def test_return_embeddings_is_the_mean_between_cls_and_the_last_sep():
    torch.manual_seed(3)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = BertModel(config, 2, get_bert_layer_local_spec(), VOCAB, SEQ, return_embeddings=True).eval()
    ids, padding_mask, types, _ = _inputs()
    with torch.no_grad():
        embeddings = model(ids, padding_mask, tokentype_ids=types)
        hidden = model.encoder(model.embedding(ids, model.bert_position_ids(ids), types),
                               model.bert_extended_attention_mask(padding_mask))
    lengths = padding_mask.sum(1).tolist()  # 12, 7, 10 tokens
    expected = torch.stack([hidden[1 : n - 1, i].mean(0) for i, n in enumerate(lengths)])
    torch.testing.assert_close(embeddings, expected)


def test_unsupported_options_are_refused_clearly():
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4)
    with pytest.raises(ValueError, match="position_embedding_type 'rope' is not supported yet"):
        BertModel(config, 2, bert_layer_local_spec, VOCAB, SEQ, position_embedding_type="rope")
    with pytest.raises(ValueError, match="return_embeddings needs post_process=True and add_binary_head=True"):
        BertModel(config, 0, bert_layer_local_spec, VOCAB, SEQ, add_binary_head=False, return_embeddings=True)
    if not is_transformer_engine_available():
        with pytest.raises(ImportError, match="needs NVIDIA Transformer Engine, which is not installed"):
            get_bert_layer_with_transformer_engine_spec()
