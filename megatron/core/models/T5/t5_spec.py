"""Layer and block specs of `T5Model` (Megatron-Core's names).

    encoder layer: norm -> self-attention (padding mask) -> norm -> MLP
    decoder layer: norm -> causal self-attention -> norm -> cross-attention to the encoder output
                   (`cross_attention.linear_q`, `linear_kv`, `linear_proj`) -> norm -> MLP
    block: the layers plus `final_layernorm`

The `*_with_transformer_engine_*` functions are Megatron's TE specs: they need Transformer Engine and then
build the local ones, which compute the same model (the norms keep their local key names).
"""

import dataclasses
import logging

from megatron.core.extensions.transformer_engine import require_transformer_engine
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.bias_dropout_add import get_bias_dropout_add
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

logger = logging.getLogger(__name__)


def encoder_model_with_local_spec() -> ModuleSpec:
    """T5 encoder layer of pure-PyTorch modules: BERT's layer, bidirectional over non-padding keys."""
    return get_bert_layer_local_spec()


def decoder_model_with_local_spec() -> ModuleSpec:
    """T5 decoder layer of pure-PyTorch modules: GPT's causal layer plus a cross-attention sub-layer."""
    spec = get_gpt_layer_local_spec()
    cross_attention = ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.padding},
        submodules=CrossAttentionSubmodules(
            linear_q=ColumnParallelLinear,
            linear_kv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
    )
    spec.submodules = dataclasses.replace(
        spec.submodules,
        pre_cross_attn_layernorm=WrappedTorchNorm,
        cross_attention=cross_attention,
        cross_attn_bda=get_bias_dropout_add,
    )
    return spec


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """`num_layers` local encoder layers and the final norm."""
    return TransformerBlockSubmodules([encoder_model_with_local_spec()] * num_layers, layer_norm=WrappedTorchNorm)


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """`num_layers` local decoder layers and the final norm."""
    return TransformerBlockSubmodules([decoder_model_with_local_spec()] * num_layers, layer_norm=WrappedTorchNorm)


def _local_instead_of_transformer_engine(feature: str) -> None:
    require_transformer_engine(feature)
    logger.warning(
        "%s builds the local T5 spec: this framework's layers are pure PyTorch (same model; the norms keep "
        "their local keys)", feature,
    )


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """Megatron's TE encoder block spec (needs Transformer Engine; builds the local one)."""
    _local_instead_of_transformer_engine("get_t5_encoder_with_transformer_engine_block_spec()")
    return get_t5_encoder_with_local_block_spec(num_layers)


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """Megatron's TE decoder block spec (needs Transformer Engine; builds the local one)."""
    _local_instead_of_transformer_engine("get_t5_decoder_with_transformer_engine_block_spec()")
    return get_t5_decoder_with_local_block_spec(num_layers)
