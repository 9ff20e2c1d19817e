"""One pre-norm transformer layer:

    x = x + dropout(attention(norm1(x)) + b_proj)
    x = x + dropout(cross_attention(norm_x(x), context) + b_proj)     decoder layers of T5 only
    x = x + dropout(mlp(norm2(x)) + b_fc2)

(with `apply_residual_connection_post_layernorm` the residual is norm(x) instead of x). The cross-attention
line is there when the spec fills the `cross_attention` slot; its keys and values come from `context`, the
encoder output [sk, b, h].

Selective recompute of "layernorm" keeps neither norm's output past the sub-layer that reads it: norm1(x) and
norm2(x) are recomputed from x when backward reaches the attention's and the MLP's output
(`CheckpointWithoutOutput`), except where the output is the residual too (post-norm residual).

x feeds both a norm and a residual addition; without that recompute our norms hand x on as the residual
themselves (`forward_with_residual`) and add its gradient into their own backward (fusions/fused_norm_residual.py)
instead of autograd adding the two in a kernel of its own.
"""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.fp8 import Fp8Recipe, Fp8Scaling, layer_runs_in_fp8, store_weight_in_fp8
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, model_parallel_rng_region
from megatron.core.transformer.activation_offload import ActivationOffload
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.pipeline_layer_split import get_transformer_layer_offset
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class TransformerLayerSubmodules:
    """Module slots of `TransformerLayer`."""

    input_layernorm: Any = IdentityOp
    self_attention: Any = IdentityOp
    self_attn_bda: Any = IdentityFuncOp
    pre_cross_attn_layernorm: Any = IdentityOp
    cross_attention: Any = IdentityOp
    cross_attn_bda: Any = IdentityFuncOp
    pre_mlp_layernorm: Any = IdentityOp
    mlp: Any = IdentityOp
    mlp_bda: Any = IdentityFuncOp


class TransformerLayer(MegatronModule):
    """[s, b, h] -> [s, b, h]. `layer_number` counts from 1 within this stage; `self.layer_number` is
    the global 1-based number (it scales query-key layer scaling)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        vp_stage: int | None = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage)
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        norm_args = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_args)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=self.layer_number)
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, **norm_args)
        self.cross_attention = build_module(submodules.cross_attention, config=config, layer_number=self.layer_number)
        self.cross_attn_bda = build_module(submodules.cross_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_args)
        self.mlp = build_module(submodules.mlp, config=config)
        if hasattr(self.mlp, "set_layer_number"):  # MoE layers log their router losses per layer
            self.mlp.set_layer_number(self.layer_number)
        self.mlp_bda = build_module(submodules.mlp_bda)
        if layer_runs_in_fp8(config, self.layer_number):
            self._use_fp8_gemms(Fp8Recipe.from_config(config))
        self._compiled_forward = None  # built on the first compiled call (`config.use_torch_compile`)
        self.recompute_layernorm = (
            config.recompute_granularity == "selective" and "layernorm" in config.recompute_modules
        )
        # Fine-grained activation offloading of each norm's saved input (activation_offload.py).
        self.attn_norm_offload = ActivationOffload(
            config, "attn_norm", enabled=not isinstance(self.input_layernorm, IdentityOp))
        self.mlp_norm_offload = ActivationOffload(
            config, "mlp_norm", enabled=not isinstance(self.pre_mlp_layernorm, IdentityOp))

    def _use_fp8_gemms(self, recipe: Fp8Recipe) -> None:
        """Runs every parallel linear of this layer (QKV, projection, fc1, fc2; cross-attention's) in FP8,
        each GEMM with its own scaling state (megatron/core/fp8); with `config.fp8_param` their weights are
        stored in FP8 (megatron/core/fp8/params.py)."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
                module.fp8 = Fp8Scaling(recipe, module.weight.device)
                if self.config.fp8_param:
                    store_weight_in_fp8(module)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb=None,
        context: torch.Tensor | None = None,
        inference_context=None,
        context_mask: torch.Tensor | None = None,
    ):
        """Returns `(hidden_states, context)`, Megatron's layer contract; `context` (the encoder output
        [sk, b, h] that cross-attention layers attend to, with `context_mask` bool [b, 1, sq or 1, sk],
        True = masked) passes through unchanged. `inference_context` is the KV cache of generation
        (megatron.core.inference).

        With `config.use_torch_compile` a training step on CUDA runs the layer compiled (forward and
        backward as generated kernels around the GEMMs and attention); every layer of the same shape
        shares one compilation. Evaluation, generation and CPU runs stay eager."""
        args = (hidden_states, attention_mask, rotary_pos_emb, context, inference_context, context_mask)
        if self.config.use_torch_compile and self.training and inference_context is None and hidden_states.is_cuda:
            if self._compiled_forward is None:
                self._compiled_forward = torch.compile(self._forward)
            return self._compiled_forward(*args)
        return self._forward(*args)

    def _forward(self, hidden_states, attention_mask, rotary_pos_emb, context, inference_context, context_mask):
        post_norm_residual = self.config.apply_residual_connection_post_layernorm
        with self.attn_norm_offload.scope():
            normed, hidden_states, recompute = self._norm(self.input_layernorm, hidden_states)
        attention_output_with_bias = self.self_attention(
            normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, inference_context=inference_context
        )
        if recompute is not None:
            recompute.discard_output_and_register_recompute(attention_output_with_bias[0])
        residual = normed if post_norm_residual else hidden_states
        bda = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)
        with self._hidden_dropout_rng():
            hidden_states = bda(attention_output_with_bias, residual, self.hidden_dropout)

        if not isinstance(self.cross_attention, IdentityOp):
            normed = self.pre_cross_attn_layernorm(hidden_states)
            attention_output_with_bias = self.cross_attention(
                normed, attention_mask=context_mask, key_value_states=context, inference_context=inference_context
            )
            residual = normed if post_norm_residual else hidden_states
            bda = self.cross_attn_bda(self.training, self.config.bias_dropout_fusion)
            with self._hidden_dropout_rng():
                hidden_states = bda(attention_output_with_bias, residual, self.hidden_dropout)

        with self.mlp_norm_offload.scope():
            normed, hidden_states, recompute = self._norm(self.pre_mlp_layernorm, hidden_states)
        mlp_output_with_bias = self.mlp(normed)
        if recompute is not None:
            recompute.discard_output_and_register_recompute(mlp_output_with_bias[0])
        residual = normed if post_norm_residual else hidden_states
        bda = self.mlp_bda(self.training, self.config.bias_dropout_fusion)
        with self._hidden_dropout_rng():
            hidden_states = bda(mlp_output_with_bias, residual, self.hidden_dropout)
        return hidden_states, context

    def _norm(self, norm, hidden_states):
        """(norm(hidden_states), hidden_states as the residual to add to, the CheckpointWithoutOutput to discard
        the norm's output with or None) (module docstring). Where the residual is the norm's input, our norms
        take the residual's gradient into their backward (`forward_with_residual`)."""
        post_norm_residual = self.config.apply_residual_connection_post_layernorm
        recompute = (self.recompute_layernorm and self.training and torch.is_grad_enabled()
                     and not post_norm_residual and not isinstance(norm, IdentityOp))
        if recompute:
            checkpoint = CheckpointWithoutOutput()
            return checkpoint.checkpoint(norm, hidden_states), hidden_states, checkpoint
        if not post_norm_residual and hasattr(norm, "forward_with_residual"):
            return *norm.forward_with_residual(hidden_states), None
        return norm(hidden_states), hidden_states, None

    def _hidden_dropout_rng(self):
        """The RNG of the residual-stream dropout. Replicated activations take the same mask on every TP
        rank (default generator); under sequence parallelism each TP rank holds another part of the
        sequence, so it draws from its own stream (Megatron forks that stream around the whole block)."""
        if self.config.sequence_parallel and self.training and self.hidden_dropout > 0:
            return model_parallel_rng_region()
        return contextlib.nullcontext()
