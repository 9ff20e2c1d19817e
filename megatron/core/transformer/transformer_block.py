"""The stack of transformer layers of one pipeline stage, plus the final norm on the last stage.

Activation recompute (`recompute_granularity`):
  full, uniform: layers run in chunks of `recompute_num_layers`; only each chunk's input is kept and
                 the chunk is recomputed in backward.
  full, block:   the first `recompute_num_layers` layers of the stage are recomputed one by one; the
                 rest keep their activations.
  selective:     inside each layer, only `recompute_modules` (core attention, MLP) are recomputed.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.pipeline_layer_split import get_num_layers_to_build
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


@dataclass
class TransformerBlockSubmodules:
    """One spec per layer of this stage, and the final norm."""

    layer_specs: list = field(default_factory=list)
    layer_norm: Any = None


def block_submodules(config: TransformerConfig, spec, vp_stage: int | None) -> TransformerBlockSubmodules:
    """Accepts block submodules, a block spec, or a single layer spec to repeat on every layer."""
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type):
        if issubclass(spec.module, TransformerBlock):
            return spec.submodules
        if issubclass(spec.module, TransformerLayer):
            layers = get_num_layers_to_build(config, vp_stage)
            return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=WrappedTorchNorm)
    raise TypeError(f"TransformerBlock spec must be a TransformerLayer/TransformerBlock ModuleSpec, got {spec!r}")


class TransformerBlock(MegatronModule):
    """[s, b, h] -> [s, b, h] through this stage's layers (`layers.0 ...`) and `final_layernorm`.

    On stages after the first (`pre_process=False`) the input comes from `set_input_tensor`. A stage may
    hold no layer (its output is then its input, or the final norm of it on the last stage).
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ):
        super().__init__(config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        submodules = block_submodules(config, spec, vp_stage)
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=index + 1, vp_stage=vp_stage)
            for index, layer_spec in enumerate(submodules.layer_specs)
        )
        if post_process and post_layer_norm and submodules.layer_norm is not None:
            self.final_layernorm = build_module(
                submodules.layer_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )
        else:
            self.final_layernorm = None
        self.input_tensor = None

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """The activation received from the previous pipeline stage."""
        self.input_tensor = input_tensor

    def _run_layers(self, start: int, end: int, inference_context=None):
        def run(hidden_states, attention_mask, rotary_pos_emb, context, context_mask):
            for layer in self.layers[start:end]:
                hidden_states, _ = layer(
                    hidden_states,
                    attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    context=context,
                    context_mask=context_mask,
                    inference_context=inference_context,
                )
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb, context, context_mask):
        num_layers, chunk = len(self.layers), self.config.recompute_num_layers
        args = (attention_mask, rotary_pos_emb, context, context_mask)
        if self.config.recompute_method == "uniform":
            for start in range(0, num_layers, chunk):
                run = self._run_layers(start, start + chunk)
                hidden_states = tensor_parallel.checkpoint(run, False, hidden_states, *args)
        else:
            for index in range(num_layers):
                run = self._run_layers(index, index + 1)
                if index < chunk:
                    hidden_states = tensor_parallel.checkpoint(run, False, hidden_states, *args)
                else:
                    hidden_states = run(hidden_states, *args)
        return hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb=None,
        inference_context=None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inference_context`: the KV cache of generation (megatron.core.inference), None in training.
        `context` [sk, b, h] and `context_mask` go to the cross-attention of decoder layers (T5)."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(
                hidden_states, attention_mask, rotary_pos_emb, context, context_mask
            )
        else:
            run = self._run_layers(0, len(self.layers), inference_context)
            hidden_states = run(hidden_states, attention_mask, rotary_pos_emb, context, context_mask)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        elif not self.pre_process and not self.layers:
            # A stage without layers (a pipeline layout may have one) must still hand on a new tensor: the
            # schedule frees its output's data and back-propagates from it to the received input.
            hidden_states = hidden_states.clone()
        return hidden_states
