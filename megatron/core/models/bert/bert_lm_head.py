"""`BertLMHead`: the transform between BERT's encoder and its (tied) output layer.

    y = LayerNorm(gelu(dense(x)))        x, y [s, b, h]

GELU is the exact (erf) one, as in Megatron-Core, whatever the MLP uses. Keys `dense.{weight,bias}` and
`layer_norm.{weight,bias}`; the vocabulary projection itself is `BertModel.output_layer`.
"""

import torch
import torch.nn.functional as F

from megatron.core.models.bert.replicated_linear import replicated_linear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig


class BertLMHead(MegatronModule):
    """Masked-LM head transform of BERT (Megatron-Core's signature)."""

    def __init__(self, hidden_size: int, config: TransformerConfig):
        super().__init__(config)
        self.dense = replicated_linear(hidden_size, hidden_size, config.init_method, config)
        # With sequence parallelism each TP rank sees different positions, so these replicated weights get
        # different partial gradients; the attribute makes the grad sync all-reduce them over TP.
        self.dense.weight.sequence_parallel = config.sequence_parallel
        self.dense.bias.sequence_parallel = config.sequence_parallel
        self.layer_norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden_states)))
