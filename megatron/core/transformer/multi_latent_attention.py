"""Multi-latent attention (DeepSeek-V2/V3): queries, keys and values come from low-rank latents, and one
rotated key part is shared by all heads.

With n heads, d_nope = qk_head_dim, d_rope = qk_pos_emb_head_dim, d_v = v_head_dim, r_q = q_lora_rank,
r_kv = kv_lora_rank, for hidden states x [s, b, h]:

    c_q  = q_layernorm(x W_dq^T)                                [s, b, r_q]   (linear_q_down_proj)
    q    = c_q W_uq^T  (x W_q^T without q compression)          [s, b, n, d_nope + d_rope]  (linear_q_up_proj)
    [c_kv, k_rope] = x W_dkv^T                                  [s, b, r_kv + d_rope]  (linear_kv_down_proj)
    [k_nope, v] = kv_layernorm(c_kv) W_ukv^T                    [s, b, n, d_nope + d_v]  (linear_kv_up_proj)
    query = [q_nope, rope(q_rope)],  key = [k_nope, rope(k_rope) for every head]
    out   = softmax(query key^T * scale) v W_o^T                (linear_proj)

rope() is applied to DeepSeek's interleaved pairs (`apply_rotary_pos_emb(mla_rotary_interleaved=True)`) with
plain RoPE or YaRN angles (`rope_type`); its YaRN concentration factor multiplies cos and sin, and the
softmax scale is yarn_get_mscale(s, mscale_all_dim)^2 / sqrt(d_nope + d_rope). The norms exist with
`qk_layernorm` (Megatron's local spec; DeepSeek's models always have them).

Tensor parallelism (p ranks): the up projections are column-parallel and the output projection row-parallel,
so each rank holds n/p whole heads (the rows of W_uq and W_ukv are per-head blocks). The down projections
and the norms are replicated on every rank (Megatron's "duplicated" linears): without sequence parallelism
all ranks compute the same latents and the shared k_rope's gradient, which each rank receives for its own
heads only, is summed over the ranks; with sequence parallelism each rank compresses its s/p positions (the
up projections gather the latents, k_rope is all-gathered) and the replicated weights' gradients are summed
over the ranks by finalize_model_grads (`sequence_parallel` on the params).

Selective recompute of "mla_up_proj" keeps neither query, key nor value past core attention: the up
projections and RoPE run again from the latents when backward reaches core attention's output.

Core attention gets the values zero-padded to the query width d_nope + d_rope (the padding is cut from its
output): the fused flash kernels (CUDA's, the CPU's) and the context-parallel ones take one head width for
queries, keys and values, and the padding costs less than SDPA's unfused fallback, which keeps the s x s
probabilities. Context parallelism then needs no change: the angles are those of this CP rank's chunks.
"""

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.tensor_parallel.layers import parameter_device
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.attention import add_offloads, cached_core_attention
from megatron.core.transformer.context_parallel import get_pos_emb_on_this_cp_rank
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.yarn import yarn_get_mscale


class ReplicatedLinear(torch.nn.Module):
    """Y = X W^T with the whole W [out, in] on every tensor-parallel rank; returns (Y, None).

    The weight is drawn from the default generator, which every rank seeds alike. Under sequence parallelism
    the ranks see different positions, so `weight.sequence_parallel` asks finalize_model_grads to sum its
    gradient over the tensor-parallel group."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False, **_):
        super().__init__()
        if bias:
            raise ValueError("the down projections of multi-latent attention have no bias (as in Megatron-Core)")
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=parameter_device(config))
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, input_: torch.Tensor):
        return F.linear(input_, self.weight), None


@dataclass
class MLASelfAttentionSubmodules:
    """Module slots of `MLASelfAttention` (Megatron-Core's names; `linear_q_proj` replaces the q down/up pair
    when q_lora_rank is None)."""

    linear_q_proj: Any = None
    linear_q_down_proj: Any = None
    linear_q_up_proj: Any = None
    linear_kv_down_proj: Any = None
    linear_kv_up_proj: Any = None
    core_attention: Any = None
    linear_proj: Any = None
    q_layernorm: Any = None
    kv_layernorm: Any = None


def mla_rotary_embedding(config: MLATransformerConfig) -> RotaryEmbedding:
    """The rotary embedding of the d_rope channels: YaRN (returns (angles, concentration)) or plain RoPE."""
    if config.rope_type == "rope":
        return RotaryEmbedding(
            config.qk_pos_emb_head_dim, config.rotary_percent, rotary_base=config.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
        )
    return YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim, rotary_base=config.rotary_base, use_cpu_initialization=config.use_cpu_initialization,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings, beta_fast=config.beta_fast,
        beta_slow=config.beta_slow, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim,
        correction_range_round_to_int=config.correction_range_round_to_int,
    )


def mla_softmax_scale(config: MLATransformerConfig) -> float:
    """yarn_get_mscale(s, mscale_all_dim)^2 / sqrt(d_nope + d_rope) (1 / sqrt(d) unless YaRN-scaled)."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class MLASelfAttention(MegatronModule):
    """[s, b, h] (or [s/p, b, h] with sequence parallelism) -> ([s, b, h], linear_proj bias or None)."""

    def __init__(
        self,
        config: MLATransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
    ):
        super().__init__(config)
        if not isinstance(config, MLATransformerConfig):
            raise ValueError(f"MLASelfAttention needs an MLATransformerConfig, got {type(config).__name__}")
        self.layer_number, self.attn_mask_type = layer_number, attn_mask_type
        self.tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_attention_heads_per_partition = config.num_attention_heads // self.tensor_parallel_size
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        heads = config.num_attention_heads
        column = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                      skip_bias_add=False)
        replicated = dict(config=config, init_method=config.init_method, bias=False)
        # Megatron-Core's registration (and state-dict) order: core attention and output projection first.
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            softmax_scale=mla_softmax_scale(config),
        )
        self.linear_proj = build_module(
            submodules.linear_proj, heads * config.v_head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True,
        )
        if config.q_lora_rank is None:
            self.linear_q_proj = build_module(submodules.linear_q_proj, config.hidden_size, heads * self.q_head_dim,
                                              **column)
        else:
            self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, config.hidden_size,
                                                   config.q_lora_rank, **replicated)
            self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, config.q_lora_rank,
                                                 heads * self.q_head_dim, **column)
        self.linear_kv_down_proj = build_module(
            submodules.linear_kv_down_proj, config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim,
            **replicated,
        )
        self.linear_kv_up_proj = build_module(
            submodules.linear_kv_up_proj, config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim),
            **column,
        )
        norm = dict(config=config, eps=config.layernorm_epsilon)
        if config.q_lora_rank is not None:
            self.q_layernorm = build_module(submodules.q_layernorm, hidden_size=config.q_lora_rank, **norm)
        self.kv_layernorm = build_module(submodules.kv_layernorm, hidden_size=config.kv_lora_rank, **norm)
        self.rotary_pos_emb = mla_rotary_embedding(config)
        self.checkpoint_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )
        self.recompute_up_projections = (
            config.recompute_granularity == "selective" and "mla_up_proj" in config.recompute_modules
        )
        add_offloads(self, config)

    def _rotary_angles(self, num_positions: int, inference_context):
        """(angles [s, 1, 1, d_rope], concentration) of this rank's s query positions: with context
        parallelism those of its two chunks of the whole sequence, in generation those after the cache."""
        cp = self.config.context_parallel_size
        offset = 0 if inference_context is None else inference_context.sequence_len_offset
        angles = self.rotary_pos_emb(num_positions * cp, offset=offset)
        angles, mscale = angles if isinstance(angles, tuple) else (angles, 1.0)
        if cp > 1:
            angles = get_pos_emb_on_this_cp_rank(angles, seq_dim=0)
        return angles, mscale

    def _shared_key_rope(self, k_rope: torch.Tensor) -> torch.Tensor:
        """k_rope [s(/p), b, d_rope] of the replicated down projection -> [s, b, d_rope] used by this rank's
        heads, whose gradient the backward sums over the tensor-parallel ranks (module docstring)."""
        if self.tensor_parallel_size == 1:
            return k_rope
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(k_rope)
        return copy_to_tensor_model_parallel_region(k_rope)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, inference_context=None):
        """[s, b, h] -> query and key [s, b, n/p, d_nope + d_rope], value [s, b, n/p, d_v]."""
        query, key, value, _ = self._query_key_value(hidden_states, inference_context, recompute=False)
        return query, key, value

    def _query_key_value(self, hidden_states: torch.Tensor, inference_context, recompute: bool):
        """(query, key, value, None) or, with `recompute`, their up projections and RoPE run by a
        CheckpointWithoutOutput, returned last, that is to discard them once core attention has used them
        (selective recompute of "mla_up_proj")."""
        config = self.config
        if config.q_lora_rank is None:
            q_latent = hidden_states
        else:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            q_latent = self.q_layernorm(q_compressed)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_compressed, k_rope = torch.split(kv_combined, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        k_rope = self._shared_key_rope(k_rope)  # [s, b, d_rope]
        up_projections = functools.partial(self._up_projections_and_rope, inference_context=inference_context)
        if not recompute:
            return (*up_projections(q_latent, self.kv_layernorm(kv_compressed), k_rope), None)
        checkpoint = CheckpointWithoutOutput()
        contiguous = lambda *latents: tuple(tensor.contiguous() for tensor in up_projections(*latents))  # noqa: E731
        return (*checkpoint.checkpoint(contiguous, q_latent, self.kv_layernorm(kv_compressed), k_rope), checkpoint)

    def _up_projections_and_rope(self, q_latent, kv_latent, k_rope, inference_context):
        """The latents (or x without q compression) and the shared k_rope [s, b, d_rope] -> query, key, value."""
        config = self.config
        if config.q_lora_rank is None:
            q, _ = self.linear_q_proj(q_latent)
        else:
            q, _ = self.linear_q_up_proj(q_latent)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        s, b = q.shape[:2]
        heads = self.num_attention_heads_per_partition
        q_nope, q_rope = q.view(s, b, heads, self.q_head_dim).split(
            [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1
        )
        k_nope, value = kv.view(s, b, heads, config.qk_head_dim + config.v_head_dim).split(
            [config.qk_head_dim, config.v_head_dim], dim=-1
        )
        angles, mscale = self._rotary_angles(s, inference_context)
        rotate = dict(mscale=mscale, mla_rotary_interleaved=True, rotary_interleaved=False)
        q_rope = apply_rotary_pos_emb(q_rope, angles, **rotate)
        k_rope = apply_rotary_pos_emb(k_rope.unsqueeze(2), angles, **rotate)
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        inference_context=None,
    ):
        if rotary_pos_emb is not None:
            raise ValueError("MLASelfAttention computes its own rotary embedding: pass rotary_pos_emb=None (GPTModel "
                             "does so for multi-latent attention)")
        recompute = self.recompute_up_projections and self.training and torch.is_grad_enabled() and (
            inference_context is None)
        with self.qkv_offload.scope():
            query, key, value, checkpoint = self._query_key_value(hidden_states, inference_context, recompute)
        pad = self.config.v_head_dim != self.q_head_dim
        with self.core_attn_offload.scope():
            context = cached_core_attention(
                self, query, key, value, attention_mask, attention_bias, packed_seq_params, inference_context,
                value_width=self.q_head_dim if pad else None,
            )
        if checkpoint is not None:
            checkpoint.discard_output_and_register_recompute(context)
        if pad:  # [s, b, n/p * (d_nope + d_rope)] -> [s, b, n/p * d_v]
            s, b = context.shape[:2]
            context = context.view(s, b, -1, self.q_head_dim)[..., : self.config.v_head_dim].reshape(s, b, -1)
        with self.attn_proj_offload.scope():
            return self.linear_proj(context)
