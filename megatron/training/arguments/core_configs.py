"""The one conversion from the validated argparse namespace to Megatron-Core's config dataclasses.

Every dataclass field whose name is also an argument is copied; the fields Megatron names differently
from their flags are mapped explicitly below.
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.activations import openai_gelu, quick_gelu, squared_relu
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.training.arguments.mla_mtp import mla_config_fields


def _same_name_fields(config_class, args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if hasattr(args, f.name)}


def _activation(args) -> dict:
    """MLP activation from --swiglu / --squared-relu / --quick-geglu / --openai-gelu (default GELU).

    The fused bias+activation kernels exist for GELU and SwiGLU only; for the other activations the
    fusion flag is moot, so it is switched off instead of being an error.
    """
    if args.swiglu:
        return {"activation_func": F.silu, "gated_linear_unit": True, "bias_activation_fusion": args.bias_swiglu_fusion}
    if args.squared_relu:
        return {"activation_func": squared_relu, "bias_activation_fusion": False}
    if args.quick_geglu:
        return {"activation_func": quick_gelu, "gated_linear_unit": True, "bias_activation_fusion": False}
    if args.openai_gelu:
        return {"activation_func": openai_gelu, "bias_activation_fusion": False}
    return {"activation_func": F.gelu, "bias_activation_fusion": args.bias_gelu_fusion}


def core_transformer_config_from_args(args: argparse.Namespace, config_class=None) -> TransformerConfig:
    """`TransformerConfig` (or `config_class`, a subclass) from validated arguments, as Megatron builds it."""
    config_class = config_class or (MLATransformerConfig if args.multi_latent_attention else TransformerConfig)
    renamed = {
        "persist_layer_norm": not args.no_persist_layer_norm,
        "layernorm_zero_centered_gamma": args.apply_layernorm_1p,
        "layernorm_epsilon": args.norm_epsilon,
        "deallocate_pipeline_outputs": True,
        "pipeline_dtype": args.params_dtype,
        "batch_p2p_comm": not args.overlap_p2p_comm,
        "num_moe_experts": args.num_experts,
        "num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
        "fp8_param": args.fp8_param_gather,
        "attention_backend": AttnBackend[args.attention_backend],
        # --num-query-groups only counts with --group-query-attention; None means one group per head.
        "num_query_groups": args.num_query_groups if args.group_query_attention else None,
        "use_cpu_initialization": bool(args.use_cpu_initialization),
        **_activation(args),
        **mla_config_fields(args),
    }
    if args.init_method_xavier_uniform:
        renamed["init_method"] = renamed["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    # One name for all layers, or one per layer.
    renamed["cp_comm_type"] = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else list(args.cp_comm_type)
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = _same_name_fields(config_class, args)
    kwargs.update({name: value for name, value in renamed.items() if name in fields})
    return config_class(**kwargs)


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """`OptimizerConfig` from validated arguments (every field is named like its flag)."""
    return OptimizerConfig(**_same_name_fields(OptimizerConfig, args))


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """`DistributedDataParallelConfig` from validated arguments, with Megatron's renamed fields."""
    kwargs = _same_name_fields(DistributedDataParallelConfig, args)
    kwargs.update(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        # The training loop checks every rank's gradients itself (bad_step.py: names the rank, then stops
        # with a checkpoint or skips); DDP's own check would raise on the one poisoned rank alone.
        check_for_nan_in_grad=False,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )
    return DistributedDataParallelConfig(**kwargs)
