"""Input embedding of a language model: word (+ learned position) (+ token type) embedding, dropout.

ids [b, s] -> [s, b, h] (sequence-first, as everything inside the transformer), or [s/p, b, h] with
sequence parallelism.
"""

import torch

from megatron.core.tensor_parallel.layers import VocabParallelEmbedding, parameter_device
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_rng_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class LanguageModelEmbedding(MegatronModule):
    """`word_embeddings` (vocab-parallel), `position_embeddings` when learned_absolute, and
    `tokentype_embeddings` when `num_tokentypes` > 0 (BERT segments)."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        num_tokentypes: int = 0,
        scatter_to_sequence_parallel: bool = True,
    ):
        super().__init__(config)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type {position_embedding_type!r} is not supported; "
                f"choose one of {', '.join(POSITION_EMBEDDING_TYPES)}"
            )
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        # Without extra embeddings to add, the word embedding can reduce-scatter straight to the
        # sequence-parallel layout instead of all-reducing and then splitting.
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding
            and num_tokentypes <= 0
            and config.sequence_parallel
            and scatter_to_sequence_parallel
        )
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            init_method=config.embedding_init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
        )
        if self.add_position_embedding:
            self.position_embeddings = self._replicated_embedding(max_sequence_length)
        if num_tokentypes > 0:
            self.tokentype_embeddings = self._replicated_embedding(num_tokentypes)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def _replicated_embedding(self, rows: int) -> torch.nn.Embedding:
        embedding = torch.nn.Embedding(
            rows, self.config.hidden_size, dtype=self.config.params_dtype, device=parameter_device(self.config)
        )
        if self.config.perform_initialization:
            with torch.no_grad():
                self.config.embedding_init_method(embedding.weight)
        return embedding

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, tokentype_ids=None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids)  # [b, s, h], or [s/p, b, h] when reduce-scattered
        if self.add_position_embedding:
            if position_ids is None:
                raise ValueError("learned_absolute position embeddings need position_ids [b, s]")
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
        if tokentype_ids is not None:
            if self.num_tokentypes <= 0:
                raise ValueError("tokentype_ids given but the embedding was built with num_tokentypes=0")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids).transpose(0, 1)
        if self.config.use_mup and self.config.mup_embedding_mult != 1.0:
            embeddings = embeddings * self.config.mup_embedding_mult
        if not self.config.sequence_parallel:
            return self.embedding_dropout(embeddings)
        if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings)
        # Each TP rank now holds a different part of the sequence: draw its dropout from the per-rank stream.
        if self.training and self.config.hidden_dropout > 0:
            with model_parallel_rng_region():
                return self.embedding_dropout(embeddings)
        return embeddings
