"""`SharedExpertMLP`: the MLP every token of a MoE layer also goes through (DeepSeek, Qwen-MoE).

    y = MLP(x)                                   (width moe_shared_expert_intermediate_size)
    y = MLP(x) * sigmoid(x . w)                  with moe_shared_expert_gate (Qwen2-MoE, Qwen3-Next): w [1, h]

The gate weight `gate_weight` is replicated over TP and drawn, as in Megatron-Core, with the model's init
method from the default generator (the same on every TP rank). Under sequence parallelism each TP rank
gates its own tokens, so its gradient is summed over TP (`sequence_parallel`).
"""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import parameter_device
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """[s, b, h] -> ([s, b, h], None): the MLP, gated per token when `config.moe_shared_expert_gate`."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, ffn_hidden_size: int | None = None):
        super().__init__(config, submodules, ffn_hidden_size=ffn_hidden_size)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            weight = torch.empty(1, config.hidden_size)
            if config.perform_initialization:
                config.init_method(weight)
            self.gate_weight = torch.nn.Parameter(weight.to(device=parameter_device(config), dtype=config.params_dtype))
            self.gate_weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor):
        output, bias = super().forward(hidden_states)
        if self.gate_weight is not None:
            output = output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return output, bias
