"""`MoELayer`: the mixture-of-experts replacement of a transformer layer's MLP.

    x [s, b, h] -> tokens [T, h] (T = s*b, or this TP rank's share) -> router -> (probs, routing_map)
      -> dispatcher.dispatch -> experts -> dispatcher.combine -> [s, b, h]  (+ shared_experts(x))

Every rank routes its own tokens: under sequence parallelism the input is already this TP rank's
[s/tp, b, h]; without it the TP ranks hold the same [s, b, h], so the layer keeps rank r's s/tp
positions (and gathers the outputs back), instead of routing every token tp times (which it does only
in generation when s does not divide by tp). A token dropped by
the capacity limit gets 0 from the experts, so the layer's residual carries it unchanged.
"""

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

_DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


@dataclass
class MoESubmodules:
    """Module slots of `MoELayer`: the local experts, and the optional shared-expert MLP."""

    experts: Any = None
    shared_experts: Any = None


class MoELayer(MegatronModule):
    """[s, b, h] -> ([s, b, h], None). State-dict keys: `router.weight`, `experts.…`, `shared_experts.…`."""

    def __init__(self, config: TransformerConfig, submodules: MoESubmodules, layer_number: int | None = None):
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts (--num-experts)")
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.num_local_experts = config.num_moe_experts // ep_size
        first = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        self.router = TopKRouter(config)
        self.experts = build_module(submodules.experts, self.num_local_experts, config, self.local_expert_indices)
        self.token_dispatcher = _DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, config
        )
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = build_module(
                submodules.shared_experts, config=config, ffn_hidden_size=config.moe_shared_expert_intermediate_size
            )
            if config.moe_shared_expert_gate and not isinstance(self.shared_experts, SharedExpertMLP):
                raise ValueError("moe_shared_expert_gate needs SharedExpertMLP in the shared_experts slot of the "
                                 f"layer spec, got {type(self.shared_experts).__name__}")
        self.layer_number = None
        if layer_number is not None:
            self.set_layer_number(layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        """Global 1-based layer number (where the router's losses are logged)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor):
        split_over_tensor_parallel = self.tensor_parallel_size > 1 and not self.config.sequence_parallel
        if split_over_tensor_parallel and hidden_states.size(0) % self.tensor_parallel_size:
            if self.training and torch.is_grad_enabled():
                raise ValueError(
                    f"MoE layers split the {hidden_states.size(0)} positions over tensor_model_parallel_size "
                    f"{self.tensor_parallel_size} ranks: use a sequence length divisible by it"
                )
            # Generation: every TP rank routes all the tokens; the dispatch sums the duplicates' expert
            # outputs back onto each copy, so the output is the same (for tp times the expert work).
            split_over_tensor_parallel = False
        tokens = hidden_states
        if split_over_tensor_parallel:
            tokens = scatter_to_sequence_parallel_region(hidden_states)  # [s/tp, b, h]
        seq_length, batch_size, hidden = tokens.shape
        flat = tokens.reshape(-1, hidden)  # [T, h], token t = position * b + sample
        probs, routing_map = self.router(flat, seq_length, batch_size)
        rows, tokens_per_expert = self.token_dispatcher.dispatch(flat, probs, routing_map)
        expert_output = self.experts(rows, tokens_per_expert)
        output = self.token_dispatcher.combine(expert_output).view(seq_length, batch_size, hidden)
        if split_over_tensor_parallel:
            # The rest of the layer is replicated over TP: each rank's output grad is the whole one.
            output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)
        if self.shared_experts is not None:
            shared_output, _ = self.shared_experts(hidden_states)
            output = output + shared_output
        return output, None
