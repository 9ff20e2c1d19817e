"""The one conversion from the validated arguments to Megatron-Core's config dataclasses.

Each config field is mapped in one place: a field named like a flag's dest is copied as is (generically,
by name); a field Megatron names differently reads its dest from the RENAMED_* tables; the few that are
computed from several flags are the functions below.
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.activations import openai_gelu, quick_gelu, squared_relu
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.training.arguments.mla_mtp import mla_config_fields

# TransformerConfig field: the dest whose value it takes.
RENAMED_TRANSFORMER_FIELDS = {
    "pipeline_dtype": "params_dtype",
    "num_moe_experts": "num_experts",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "fp8_param": "fp8_param_gather",
}

# DistributedDataParallelConfig field: the dest whose value it takes.
RENAMED_DDP_FIELDS = {
    "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32",
    "bucket_size": "ddp_bucket_size",
    "average_in_collective": "ddp_average_in_collective",
    "reshard_after_forward": "torch_fsdp2_reshard_after_forward",  # TorchFullyShardedDataParallelConfig's
}


def _mapped_fields(config_class, args: argparse.Namespace, renamed: dict) -> dict:
    """{field: value} of every field of `config_class` that `args` holds under the field's name or, for
    the fields in `renamed`, under the dest named there."""
    values = {}
    for field in dataclasses.fields(config_class):
        dest = renamed.get(field.name, field.name)
        if hasattr(args, dest):
            values[field.name] = getattr(args, dest)
    return values


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


def _computed_transformer_fields(args) -> dict:
    """The TransformerConfig fields that no single flag holds as is."""
    computed = {
        "persist_layer_norm": not args.no_persist_layer_norm,
        "deallocate_pipeline_outputs": True,
        "batch_p2p_comm": not args.overlap_p2p_comm,
        "attention_backend": AttnBackend[args.attention_backend],
        # --num-query-groups only counts with --group-query-attention; None means one group per head.
        "num_query_groups": args.num_query_groups if args.group_query_attention else None,
        "use_cpu_initialization": bool(args.use_cpu_initialization),
        # One name for all layers, or one per layer.
        "cp_comm_type": args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else list(args.cp_comm_type),
        **_activation(args),
        **mla_config_fields(args),
    }
    if args.init_method_xavier_uniform:
        computed["init_method"] = computed["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    return computed


def core_transformer_config_from_args(args: argparse.Namespace, config_class=None) -> TransformerConfig:
    """`TransformerConfig` (or `config_class`, a subclass) from validated arguments, as Megatron builds it."""
    config_class = config_class or (MLATransformerConfig if args.multi_latent_attention else TransformerConfig)
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = _mapped_fields(config_class, args, RENAMED_TRANSFORMER_FIELDS)
    kwargs.update({name: value for name, value in _computed_transformer_fields(args).items() if name in fields})
    return config_class(**kwargs)


def optimizer_config_from_args(args: argparse.Namespace) -> OptimizerConfig:
    """`OptimizerConfig` from validated arguments (every field is named like its flag)."""
    return OptimizerConfig(**_mapped_fields(OptimizerConfig, args, {}))


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """`DistributedDataParallelConfig` from validated arguments, with Megatron's renamed fields (a
    `TorchFullyShardedDataParallelConfig` with --use-torch-fsdp2)."""
    config_class = TorchFullyShardedDataParallelConfig if args.use_torch_fsdp2 else DistributedDataParallelConfig
    kwargs = _mapped_fields(config_class, args, RENAMED_DDP_FIELDS)
    # The training loop checks every rank's gradients itself (bad_step.py: names the rank, then stops
    # with a checkpoint or skips); DDP's own check would raise on the one poisoned rank alone.
    kwargs["check_for_nan_in_grad"] = False
    if "num_distributed_optimizer_instances" in kwargs:
        # One instance: --num-distributed-optimizer-instances changes only Megatron-LM's speed (without_effect.py).
        kwargs["num_distributed_optimizer_instances"] = 1
    return config_class(**kwargs)
