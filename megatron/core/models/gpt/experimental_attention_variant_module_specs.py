"""Layer specs of a GPT whose layers mix Gated DeltaNet linear attention with softmax attention (Qwen3-Next),
Megatron-Core's `get_transformer_block_with_experimental_attention_variant_spec`.

Two patterns, one entry per layer of the model, pick each layer's modules independently:

    attention  `linear_attention_freq` N: layer i (from 0) is softmax attention when (i + 1) % N == 0,
               Gated DeltaNet otherwise (N = 4: GDN, GDN, GDN, attention, ...); or a 0/1 list (1 = GDN)
    MLP        `moe_layer_freq`: MoE or dense (moe_config_checks.moe_layer_pattern)

Each pipeline stage takes the entries of its own layers. The layers are this project's local modules
(Megatron-Core builds Transformer Engine ones: the same maths, with the input norm fused into `in_proj`);
the softmax-attention and MLP slots are those of `get_gpt_layer_local_spec`.
"""

import dataclasses

from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.config_rules import linear_attention_pattern
from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
from megatron.core.transformer.pipeline_layer_split import get_num_layers_to_build, get_transformer_layer_offset
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


def get_gated_delta_net_module_spec(config: TransformerConfig, backend=None) -> ModuleSpec:
    """The attention slot of a Gated DeltaNet layer; its output norm is the model's `normalization`."""
    reject_unsupported("get_gated_delta_net_module_spec", backend=backend is not None)
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=ModuleSpec(module=WrappedTorchNorm, params={"normalization": config.normalization}),
            out_proj=RowParallelLinear,
        ),
    )


def get_linear_attention_pattern(config: TransformerConfig) -> list[int]:
    """One entry per layer of the model, 1 = Gated DeltaNet, 0 = softmax attention (module docstring)."""
    return linear_attention_pattern(config.num_layers, config.experimental_attention_variant,
                                    config.linear_attention_freq)


def get_transformer_layer_with_experimental_attention_variant_spec(config: TransformerConfig,
                                                                    backend=None) -> list[ModuleSpec]:
    """One layer spec per layer of the model (module docstring)."""
    reject_unsupported("get_transformer_layer_with_experimental_attention_variant_spec", backend=backend is not None)
    shape = dict(qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
                 normalization=config.normalization)
    dense = get_gpt_layer_local_spec(**shape)
    moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                   **shape) if config.num_moe_experts else None
    gdn = get_gated_delta_net_module_spec(config)
    mlp_pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq) if moe else [0] * config.num_layers
    specs = []
    for is_linear, is_moe in zip(get_linear_attention_pattern(config), mlp_pattern):
        layer = moe if is_moe else dense
        if is_linear:
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=gdn))
        specs.append(layer)
    return specs


def get_transformer_block_with_experimental_attention_variant_spec(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The layer specs of this pipeline stage's layers (virtual stage `vp_stage` of rank `pp_rank`, default
    this rank's) and the final norm."""
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    count = get_num_layers_to_build(config, vp_stage, pp_rank)
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config)[offset : offset + count]
    return TransformerBlockSubmodules(
        layer_specs=layers, layer_norm=ModuleSpec(module=WrappedTorchNorm, params={"normalization": config.normalization})
    )
