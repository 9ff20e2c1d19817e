"""Layer specs of `BertModel`: the GPT layer with bidirectional (padding-masked) self-attention.

    bert_layer_local_spec                       pure-PyTorch modules, Megatron-Core's local key names
    get_bert_layer_local_spec()                 the same, built on demand
    get_bert_layer_with_transformer_engine_spec()   Megatron's TE spec: needs TE, then builds the local one

The layer is pre-norm; with `apply_residual_connection_post_layernorm` it computes the original
(post-norm) BERT, see `BertModel`.
"""

import logging

from megatron.core.extensions.transformer_engine import require_transformer_engine
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

logger = logging.getLogger(__name__)


def get_bert_layer_local_spec() -> ModuleSpec:
    """A BERT encoder layer of pure-PyTorch modules: GPT's local layer (same slots and key names) whose
    self-attention sees every non-padding position instead of the causal past."""
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.padding}
    return spec


bert_layer_local_spec = get_bert_layer_local_spec()


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """Megatron-Core's TE spec. Raises ImportError (saying what to install) without Transformer Engine;
    with it, returns the local spec, which computes the same layer (keys keep the local norm names)."""
    require_transformer_engine("get_bert_layer_with_transformer_engine_spec()")
    logger.warning(
        "get_bert_layer_with_transformer_engine_spec() builds the local spec: this framework's layers are "
        "pure PyTorch (same model; the norms keep the local keys input_layernorm/pre_mlp_layernorm)"
    )
    return get_bert_layer_local_spec()
