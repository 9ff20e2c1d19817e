"""`Pooler`: the hidden state of one position (BERT's [CLS], position 0) through dense + tanh."""

import torch

from megatron.core import tensor_parallel
from megatron.core.models.bert.replicated_linear import replicated_linear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class Pooler(MegatronModule):
    """[s, b, h] -> tanh(dense(hidden[sequence_index])) [b, h]. Key `dense.{weight,bias}`.

    With sequence parallelism each TP rank holds s/p positions; the sequence is gathered first so that
    every rank pools the same position (and the gradient goes back to the rank that holds it).
    """

    def __init__(self, hidden_size: int, init_method, config: TransformerConfig, sequence_parallel: bool = False):
        super().__init__(config)
        self.dense = replicated_linear(hidden_size, hidden_size, init_method, config)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.tanh(self.dense(hidden_states[sequence_index]))
