"""BERT of Megatron-Core: `BertModel`, its layer specs, LM head and pooler."""

from megatron.core.models.bert.bert_model import BertModel

__all__ = ["BertModel"]
