"""The feed-forward block: fc1 -> activation -> fc2.

    plain:  y = fc2(act(fc1(x)))                    fc1: h -> f
    GLU:    [gate, up] = fc1(x);  y = fc2(act(gate) * up)     fc1: h -> 2f   (SwiGLU with act = SiLU)

fc1 is column-parallel and fc2 row-parallel, so the f dimension is split over TP with one all-reduce
at the end. For GLU each TP rank holds [gate_r; up_r] (the fused weight is split in two halves, each
half split over TP), so the full `linear_fc1.weight` is cat([gate, up]) along dim 0.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.activations import openai_gelu
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLPSubmodules:
    """Module slots of `MLP`."""

    linear_fc1: Any = None
    linear_fc2: Any = None


class MLP(MegatronModule):
    """[s, b, h] -> ([s, b, h], linear_fc2 bias or None)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: int | None = None,
        ffn_hidden_size: int | None = None,
    ):
        super().__init__(config)
        reject_unsupported("MLP", is_expert=is_expert)
        input_size = config.hidden_size if input_size is None else input_size
        ffn_hidden_size = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        glu = config.gated_linear_unit
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            input_size,
            2 * ffn_hidden_size if glu else ffn_hidden_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            stride=2 if glu else 1,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        activation = config.activation_func
        # Megatron's fused bias-GELU kernel computes the tanh approximation, so the flag changes the function.
        if config.bias_activation_fusion and activation is F.gelu:
            activation = openai_gelu
        self.activation_func = activation
        # One generated kernel for bias + activation (+ gating) on CUDA: bias-GeLU(tanh) and bias-SwiGLU.
        self.fused_activation = None
        if config.bias_activation_fusion:
            if glu and config.activation_func is F.silu:
                self.fused_activation = bias_swiglu_impl
            elif not glu and config.activation_func is F.gelu:
                self.fused_activation = bias_gelu_impl
        self.recompute_mlp = config.recompute_granularity == "selective" and "mlp" in config.recompute_modules

    def _activation(self, intermediate: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fused_activation is not None:
            return self.fused_activation(intermediate, bias)
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.activation_func(gate) * up
        return self.activation_func(intermediate)

    def _forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, f/p] or [s, b, 2f/p]
        return self.linear_fc2(self._activation(intermediate, bias))

    def forward(self, hidden_states: torch.Tensor):
        if self.recompute_mlp and self.training:
            return tensor_parallel.checkpoint(self._forward, False, hidden_states)
        return self._forward(hidden_states)
