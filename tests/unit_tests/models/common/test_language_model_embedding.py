"""LanguageModelEmbedding: word + position + token-type lookups, sequence-first output."""

import pytest
import torch

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig


def test_sum_of_lookups_transposed_to_sequence_first():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, hidden_dropout=0.0)
    embedding = LanguageModelEmbedding(config, vocab_size=20, max_sequence_length=6, num_tokentypes=2)
    ids = torch.randint(0, 20, (3, 6))
    positions = torch.arange(6).expand(3, 6)
    types = torch.randint(0, 2, (3, 6))
    output = embedding(ids, positions, tokentype_ids=types)
    expected = (
        embedding.word_embeddings.weight[ids]
        + embedding.position_embeddings.weight[positions]
        + embedding.tokentype_embeddings.weight[types]
    )
    assert output.shape == (6, 3, 8)
    torch.testing.assert_close(output, expected.transpose(0, 1))


def test_rope_models_have_no_position_table_and_bad_types_are_named():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    embedding = LanguageModelEmbedding(config, 20, 6, position_embedding_type="rope")
    assert not hasattr(embedding, "position_embeddings")
    with pytest.raises(ValueError, match="'alibi' is not supported"):
        LanguageModelEmbedding(config, 20, 6, position_embedding_type="alibi")
