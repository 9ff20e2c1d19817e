"""Layer specs for `GPTModel`: which module fills each slot of a transformer layer.

The local spec gives a pre-norm layer of pure-PyTorch modules whose state-dict keys are Megatron-Core's
local names (`input_layernorm`, `self_attention.linear_qkv`, `pre_mlp_layernorm`, `mlp.linear_fc1`, ...).
"""

import logging

from megatron.core.extensions.transformer_engine import require_transformer_engine
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.bias_dropout_add import get_bias_dropout_add
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
    ReplicatedLinear,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

logger = logging.getLogger(__name__)


def get_gpt_layer_local_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    moe_use_legacy_grouped_gemm: bool = False,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
    use_kitchen: bool = False,
) -> ModuleSpec:
    """Spec of a GPT layer built from pure-PyTorch modules.

    With `num_experts` the MLP slot holds a `MoELayer` (router, experts, optional shared experts);
    `moe_grouped_gemm` picks `GroupedMLP` (keys `experts.linear_fc1.weight{i}`) over `SequentialMLP`
    (keys `experts.local_experts.{i}.linear_fc1.weight`).

    `normalization` ("LayerNorm"/"RMSNorm") fixes the norm type; by default `config.normalization`
    decides when the model is built. `qk_layernorm` adds per-head norms of the queries and keys, or with
    `multi_latent_attention` (`MLASelfAttention`) the norms of the query and key/value latents.
    """
    if fp8 is not None:
        logger.warning("get_gpt_layer_local_spec(fp8=...) is deprecated (as in Megatron-Core) and has no effect: "
                       "FP8 is TransformerConfig.fp8")
    reject_unsupported(
        "get_gpt_layer_local_spec",
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
        qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen,
    )
    if normalization is None:
        layer_norm = WrappedTorchNorm
    elif normalization in ("LayerNorm", "RMSNorm"):
        layer_norm = ModuleSpec(module=WrappedTorchNorm, params={"normalization": normalization})
    else:
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    head_norm = layer_norm if qk_layernorm else IdentityOp
    if multi_latent_attention:
        self_attention = ModuleSpec(
            module=MLASelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear,
                linear_q_down_proj=ReplicatedLinear,
                linear_q_up_proj=ColumnParallelLinear,
                linear_kv_down_proj=ReplicatedLinear,
                linear_kv_up_proj=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=head_norm,
                kv_layernorm=head_norm,
            ),
        )
    else:
        self_attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=head_norm,
                k_layernorm=head_norm,
            ),
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=layer_norm,
            self_attention=self_attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=layer_norm,
            mlp=_mlp_spec(num_experts, moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _dense_mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def _mlp_spec(num_experts: int | None, moe_grouped_gemm: bool) -> ModuleSpec:
    if num_experts is None:
        return _dense_mlp_spec()
    shared_experts = ModuleSpec(
        module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=GroupedMLP if moe_grouped_gemm else SequentialMLP, shared_experts=shared_experts
        ),
    )


def get_gpt_decoder_block_spec(
    config,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
    vp_stage: int | None = None,
) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline stage's layers: MoE where `moe_layer_pattern` says so, dense
    elsewhere (Megatron-Core's choice for `--num-experts` with `--moe-layer-freq`)."""
    spec_args = dict(
        qk_layernorm=config.qk_layernorm, qk_l2_norm=qk_l2_norm, multi_latent_attention=config.multi_latent_attention
    )
    if use_transformer_engine:
        dense = get_gpt_layer_with_transformer_engine_spec(**spec_args)
        moe = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm, **spec_args
        )
    else:
        dense = get_gpt_layer_local_spec(normalization=normalization, **spec_args)
        moe = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            normalization=normalization, **spec_args,
        )
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    offset = get_transformer_layer_offset(config, vp_stage)
    stage_pattern = pattern[offset : offset + get_num_layers_to_build(config, vp_stage)]
    layer_norm = (
        WrappedTorchNorm if normalization is None
        else ModuleSpec(module=WrappedTorchNorm, params={"normalization": normalization})
    )
    return TransformerBlockSubmodules(
        layer_specs=[moe if is_moe else dense for is_moe in stage_pattern], layer_norm=layer_norm
    )


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    moe_use_legacy_grouped_gemm: bool = False,
    qk_l2_norm: bool = False,
    use_te_op_fuser: bool = False,
    use_kitchen: bool = False,
) -> ModuleSpec:
    """Megatron-Core's Transformer Engine spec. Raises ImportError (saying what to install) without TE.

    With TE installed this returns the local spec: our PyTorch layers compute the same model, so the
    TE kernels are not needed. The layer norms then keep their local keys (`input_layernorm.weight`)
    instead of TE's fused `linear_qkv.layer_norm_weight`; a warning says so.
    """
    require_transformer_engine("get_gpt_layer_with_transformer_engine_spec()")
    reject_unsupported("get_gpt_layer_with_transformer_engine_spec", use_te_op_fuser=use_te_op_fuser)
    logger.warning(
        "Transformer Engine is installed, but this framework's layers are pure PyTorch: "
        "get_gpt_layer_with_transformer_engine_spec() builds the local spec (same model; state-dict keys "
        "use the local names input_layernorm/pre_mlp_layernorm instead of TE's fused layer_norm_weight)"
    )
    return get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        fp8=fp8,
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
        qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen,
    )
