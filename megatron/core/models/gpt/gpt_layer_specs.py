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
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

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

    `normalization` ("LayerNorm"/"RMSNorm") fixes the norm type; by default `config.normalization`
    decides when the model is built. `qk_layernorm` adds per-head norms of the queries and keys.
    """
    reject_unsupported(
        "get_gpt_layer_local_spec",
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        multi_latent_attention=multi_latent_attention,
        fp8=fp8,
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
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=layer_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=head_norm,
                    k_layernorm=head_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=layer_norm,
            mlp=ModuleSpec(
                module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            ),
            mlp_bda=get_bias_dropout_add,
        ),
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
