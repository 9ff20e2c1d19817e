"""Self-attention: fused QKV projection, optional QK norm, RoPE, core attention, output projection.

QKV layout (Megatron-Core, checkpoint version 3): the rows of `linear_qkv.weight` [ng*(np/ng+2)*hn, h]
are grouped per key/value group g = 0..ng-1: the group's np/ng query heads, then its key head, then its
value head, hn rows each. Viewed as [ng, np/ng + 2, hn, h]; for plain multi-head attention (ng = np)
that is [np, 3, hn, h] = q0 k0 v0 q1 k1 v1 ... The column-parallel split of dim 0 therefore gives
each TP rank ng/p whole groups.

With `attention_output_gate` (Qwen3-Next) each group also holds a gate per query head, after its queries:
[ng, 2 np/ng + 2, hn, h] = the group's queries, their gates, its key, its value; the attention output of
query head i, channel c is multiplied by sigmoid(gate) of the same head and channel (in fp32) before
linear_proj.

With fewer groups than TP ranks (ng < p, p a multiple of ng) a rank's rows are a 1/(p/ng) slice of one
group, not whole heads. As in Megatron-Core, the ranks then all-gather the QKV output, keep group
g = rank // (p/ng) and, of its np/ng query heads, the np/p with index rank % (p/ng); the key/value head is
computed on the p/ng ranks that share it, and the all-gather's backward (a reduce-scatter) sums its
gradient over them.
"""

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.fusions.fused_rope import fused_apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.activation_offload import ActivationOffload
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class SelfAttentionSubmodules:
    """Module slots of `SelfAttention`."""

    linear_qkv: Any = None
    core_attention: Any = None
    linear_proj: Any = None
    q_layernorm: Any = None
    k_layernorm: Any = None


class SelfAttention(MegatronModule):
    """[s, b, h] -> ([s, b, h], linear_proj bias or None). The bias is returned, not added, so that it
    can join the residual add (bias-dropout-add)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.hidden_size_per_attention_head = config.kv_channels
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        # TransformerConfig checked that ng is a multiple or a divisor of p.
        self.ranks_per_query_group = max(tp // config.num_query_groups, 1)
        self.num_query_groups_per_partition = max(config.num_query_groups // tp, 1)

        # Registered after core_attention and linear_proj, as in Megatron-Core (whose Attention base class
        # builds those two): the parameter and state-dict order, by which a torch-format optimizer state is
        # indexed. Built first, so the initial weights are drawn in the same order as before.
        self.output_gate = config.attention_output_gate
        linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            self.query_projection_size * (2 if self.output_gate else 1) + 2 * self.kv_projection_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False,
        )
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=attn_mask_type
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        self.linear_qkv = linear_qkv
        self.q_layernorm = self._build_head_norm(submodules.q_layernorm)
        self.k_layernorm = self._build_head_norm(submodules.k_layernorm)
        self.checkpoint_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )
        add_offloads(self, config)

    def _build_head_norm(self, spec):
        if spec is None:
            return None
        return build_module(
            spec, hidden_size=self.hidden_size_per_attention_head, config=self.config, eps=self.config.layernorm_epsilon
        )

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, output_gate: bool = False):
        """[s, b, h] -> query [s, b, np/p, hn], key and value [s, b, max(ng/p, 1), hn]; with `output_gate`
        also the gate [s, b, np/p, hn] (module docstring)."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # [s, b, (np [+ np] + 2 ng) * hn / p]
        if self.ranks_per_query_group > 1:
            mixed_qkv = self._own_query_group(mixed_qkv)  # [s, b, (np/ng [+ np/ng] + 2) * hn]
        heads_per_group = self.config.num_attention_heads // self.config.num_query_groups
        hn = self.hidden_size_per_attention_head
        s, b = mixed_qkv.shape[:2]
        query_rows = heads_per_group * hn * (2 if output_gate else 1)
        mixed_qkv = mixed_qkv.view(s, b, self.num_query_groups_per_partition, query_rows + 2 * hn)
        query, key, value = torch.split(mixed_qkv, [query_rows, hn, hn], dim=3)
        query, gate = query.split(heads_per_group * hn, dim=3) if output_gate else (query, None)
        query = self._own_query_heads(query)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if self.config.test_mode:
            self.run_realtime_tests()
        if output_gate:
            return query, key, value, self._own_query_heads(gate)
        return query, key, value

    @torch.no_grad()
    def run_realtime_tests(self) -> None:
        """`test_mode`'s check, Megatron-Core's: the QK norms' params of this layer are bit-identical on every
        data-parallel and tensor-parallel rank (all-gathered over each group and compared); a RuntimeError names
        the param, the group, the two ranks and the norm of their difference. Without QK norms it checks
        nothing, as Megatron-Core."""
        norms = {"q_layernorm": self.q_layernorm, "k_layernorm": self.k_layernorm}
        named = [(f"{norm}.{name}", param) for norm, module in norms.items() if module is not None
                 for name, param in module.named_parameters()]
        if not named or not parallel_state.model_parallel_is_initialized():
            return
        local = torch.cat([param.detach().reshape(-1) for _, param in named])
        for kind, group in (("data-parallel", parallel_state.get_data_parallel_group()),
                            ("tensor-parallel", parallel_state.get_tensor_model_parallel_group())):
            size = torch.distributed.get_world_size(group)
            if size == 1:
                continue
            gathered = [torch.empty_like(local) for _ in range(size)]
            torch.distributed.all_gather(gathered, local, group=group)
            rank = torch.distributed.get_rank(group)
            for other, values in enumerate(gathered):
                start = 0
                for name, param in named:
                    mine, theirs = local[start : start + param.numel()], values[start : start + param.numel()]
                    start += param.numel()
                    if not torch.equal(mine, theirs):
                        raise RuntimeError(
                            f"--test-mode: layer {self.layer_number} {name} differs between {kind} ranks {other} "
                            f"and {rank} (norm of the difference {torch.norm((mine - theirs).float()).item():.6g}): "
                            "a replica was corrupted (memory, network or checkpoint loading)"
                        )

    def _own_query_heads(self, per_group: torch.Tensor) -> torch.Tensor:
        """[s, b, groups, np/ng * hn] -> [s, b, np/p, hn]: with ng < p, this rank's np/p of its group's heads."""
        s, b = per_group.shape[:2]
        heads = per_group.reshape(s, b, -1, self.hidden_size_per_attention_head)
        if self.ranks_per_query_group > 1:
            first = parallel_state.get_tensor_model_parallel_rank() % self.ranks_per_query_group
            local_heads = self.num_attention_heads_per_partition
            heads = heads[:, :, first * local_heads : (first + 1) * local_heads]
        return heads

    def _own_query_group(self, mixed_qkv: torch.Tensor) -> torch.Tensor:
        """[s, b, (np + 2 ng) * hn / p] -> [s, b, (np/ng + 2) * hn]: all of group rank // (p/ng) (ng < p)."""
        full = tensor_parallel.all_gather_last_dim_from_tensor_parallel_region(mixed_qkv)
        group_width = full.size(-1) // self.config.num_query_groups
        group = parallel_state.get_tensor_model_parallel_rank() // self.ranks_per_query_group
        return full[..., group * group_width : (group + 1) * group_width]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        inference_context=None,
    ):
        """With an `inference_context` (KV cache) the new keys/values join the cached ones and the queries
        attend over all of them; `rotary_pos_emb` must then hold the angles of the new positions."""
        with self.qkv_offload.scope():
            query, key, value, *gate = self.get_query_key_value_tensors(hidden_states, output_gate=self.output_gate)
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            rotate = fused_apply_rotary_pos_emb if self.config.apply_rope_fusion else apply_rotary_pos_emb
            query = rotate(query, q_pos_emb, config=self.config)
            key = rotate(key, k_pos_emb, config=self.config)
        with self.core_attn_offload.scope():
            context = cached_core_attention(
                self, query, key, value, attention_mask, attention_bias, packed_seq_params, inference_context
            )
        if gate:
            context = (context * torch.sigmoid(gate[0].reshape(context.shape).float())).to(context.dtype)
        with self.attn_proj_offload.scope():
            return self.linear_proj(context)


def add_offloads(attention, config: TransformerConfig) -> None:
    """The fine-grained activation offloads of a self-attention module (activation_offload.py): its query/key/
    value projections, its core attention and its output projection."""
    attention.qkv_offload = ActivationOffload(config, "qkv_linear")
    attention.core_attn_offload = ActivationOffload(config, "core_attn")
    attention.attn_proj_offload = ActivationOffload(config, "attn_proj")


def cached_core_attention(
    attention, query, key, value, attention_mask, attention_bias, packed_seq_params, inference_context,
    value_width: int | None = None,
) -> torch.Tensor:
    """`attention.core_attention` of query [sq, b, np/p, hn] over key/value [sk, b, ., .] -> [sq, b, np/p * hv],
    shared by the self-attention modules (`attention` has `layer_number`, `attn_mask_type`, `core_attention`,
    `checkpoint_core_attention`, `training`).

    With an `inference_context` the new keys/values first join the cached ones (and the causal mask is aligned
    to the cache). The core attention is recomputed in backward with selective recompute of "core_attn".
    `value_width` zero-pads the values' last dimension to that width after caching (multi-latent attention)."""
    mask_type = None
    if inference_context is not None:
        key, value = inference_context.append_key_value(attention.layer_number, key, value)
        if attention_mask is None and attention.attn_mask_type == AttnMaskType.causal:
            attention_mask, mask_type = causal_mask_over_cache(query.size(0), key.size(0), query.device)
    if value_width is not None:
        value = torch.nn.functional.pad(value, [0, value_width - value.size(-1)])
    core_args = (query, key, value, attention_mask, mask_type, attention_bias, packed_seq_params)
    if attention.checkpoint_core_attention and attention.training:
        return tensor_parallel.checkpoint(attention.core_attention, False, *core_args)
    return attention.core_attention(*core_args)


def causal_mask_over_cache(num_queries: int, num_keys: int, device: torch.device):
    """(attention_mask, mask type override) for sq new queries over sk >= sq cached keys.

    Query i sits at absolute position sk - sq + i and sees keys 0 .. sk - sq + i, i.e. the causal mask
    aligned to the bottom-right corner. sq = sk (nothing cached before) is the plain causal case, which
    core attention builds itself; a single query sees every key and needs no mask at all.
    """
    if num_queries == num_keys:
        return None, None
    if num_queries == 1:
        return None, AttnMaskType.no_mask
    masked = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).triu(num_keys - num_queries + 1)
    return masked, None  # [sq, sk], True = masked


@dataclass
class CrossAttentionSubmodules:
    """Module slots of `CrossAttention`."""

    linear_q: Any = None
    linear_kv: Any = None
    core_attention: Any = None
    linear_proj: Any = None


class CrossAttention(MegatronModule):
    """Decoder queries [sq, b, h] attend to encoder keys/values [sk, b, h] (T5); returns ([sq, b, h],
    linear_proj bias or None).

    `linear_q.weight` is [np*hn, h]; `linear_kv.weight` [np * 2 * hn, h] holds per head its key rows then
    its value rows (k0 v0 k1 v1 ...), so the column-parallel split gives each TP rank np/p whole heads.
    Every query head has its own key/value head, as in Megatron-Core.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: CrossAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
    ):
        super().__init__(config)
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError(
                f"CrossAttention has one key/value head per query head: num_query_groups "
                f"({config.num_query_groups}) must equal num_attention_heads ({config.num_attention_heads})"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        projection_size = config.kv_channels * config.num_attention_heads
        column_args = dict(
            config=config, init_method=config.init_method, gather_output=False, bias=config.add_bias_linear,
            skip_bias_add=False,
        )
        # Registered after core_attention and linear_proj as in Megatron-Core (see SelfAttention), built first.
        linear_q = build_module(submodules.linear_q, config.hidden_size, projection_size, **column_args)
        linear_kv = build_module(submodules.linear_kv, config.hidden_size, 2 * projection_size, **column_args)
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="cross",
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        self.linear_q, self.linear_kv = linear_q, linear_kv
        self.checkpoint_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )
        add_offloads(self, config)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor):
        """hidden [sq, b, h], key_value_states [sk, b, h] -> query [sq, b, np/p, hn], key and value
        [sk, b, np/p, hn]."""
        heads, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_kv, _ = self.linear_kv(key_value_states)  # [sk, b, np/p * 2 * hn]
        key, value = mixed_kv.view(*mixed_kv.shape[:2], heads, 2 * hn).split(hn, dim=3)
        query, _ = self.linear_q(hidden_states)  # [sq, b, np/p * hn]
        return query.view(*query.shape[:2], heads, hn), key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        inference_context=None,
        rotary_pos_emb=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ):
        """`attention_mask` bool, broadcastable to [b, np, sq, sk], True = masked (encoder padding)."""
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states: the encoder output [sk, b, h] (`context`)")
        reject_unsupported(
            "CrossAttention", inference_context=inference_context is not None, rotary_pos_emb=rotary_pos_emb is not None
        )
        with self.qkv_offload.scope():
            query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        core_args = (query, key, value, attention_mask, None, attention_bias, packed_seq_params)
        with self.core_attn_offload.scope():
            if self.checkpoint_core_attention and self.training:
                context = tensor_parallel.checkpoint(self.core_attention, False, *core_args)
            else:
                context = self.core_attention(*core_args)
        with self.attn_proj_offload.scope():
            return self.linear_proj(context)
