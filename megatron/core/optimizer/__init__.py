"""Megatron optimizers: `get_megatron_optimizer(config, model_chunks)` builds the one a run needs.

    fp32 params                 FP32Optimizer(AdamW or SGD)
    --bf16 / --fp16             Float16OptimizerWithFloat16Params (fp32 main params), with a
                                DynamicGradScaler under --fp16 (ConstantGradScaler with --loss-scale)
    --use-distributed-optimizer DistributedOptimizer(AdamW): main params and Adam state sharded over
                                data-parallel ranks (any precision; the model must be wrapped in
                                DistributedDataParallel with use_distributed_optimizer)
    FSDP (DTensor params)       FullyShardedOptimizer(AdamW or SGD) on the fp32 shards
                                (TorchFullyShardedDataParallel), any precision but fp16
    expert-parallel params too  ChainedOptimizer([dense optimizer, expert optimizer])
    --optimizer muon            ChainedOptimizer of Muon (muon.py) for the weight matrices and AdamW for the other
                                params, each in the precision wrapper (dense and expert apart)

Adam is `torch.optim.AdamW` (decoupled weight decay, as Megatron's FusedAdam in AdamW mode), fused into
one kernel when the params live on a GPU; the mixed-precision wrappers step it with fusions/fused_adamw.py
on CUDA. apex's FusedAdam is not used (extensions/apex.py says why).
"""

import importlib.util
import logging
from typing import Callable, Dict, List, Optional

import torch

from .. import parallel_state
from ..dtensor_shards import is_fully_sharded
from .chained_optimizer import ChainedOptimizer
from .distrib_optimizer import DistributedOptimizer
from .fully_sharded_optimizer import FullyShardedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .muon import TensorParallelMuon, is_muon_param, mark_qkv_params
from .mup import mup_group_overrides
from .optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params, MegatronOptimizer, MixedPrecisionOptimizer
from .optimizer_config import OptimizerConfig
from .param_groups import get_param_groups, set_min_and_max_lr

__all__ = [
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "FullyShardedOptimizer",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "TensorParallelMuon",
    "get_megatron_optimizer",
]

logger = logging.getLogger(__name__)


def _params_device(param_groups: List[Dict]) -> torch.device:
    devices = {param.device for group in param_groups for param in group["params"]}
    if len(devices) != 1:
        raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")
    return devices.pop()


def _inner_optimizer(config: OptimizerConfig, param_groups: List[Dict], device: torch.device, name: str):
    if name == "muon":
        return TensorParallelMuon(
            param_groups, lr=config.lr, momentum=config.muon_momentum, weight_decay=config.weight_decay,
            nesterov=config.muon_nesterov, split_qkv=config.muon_split_qkv,
            fp32_matmul_prec=config.muon_fp32_matmul_prec, coefficient_type=config.muon_coefficient_type,
            num_ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
            extra_scale_factor=config.muon_extra_scale_factor, tp_mode=config.muon_tp_mode,
        )
    if name == "adam":
        adam_class = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return adam_class(
            param_groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            # The fused kernel updates every tensor of a group in one launch; on CPU the default
            # (foreach) implementation is used.
            **({"fused": True} if device.type == "cuda" else {}),
        )
    if name == "sgd":
        return torch.optim.SGD(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                               momentum=config.sgd_momentum)
    raise ValueError(f"optimizer {name!r} is not supported yet; choose adam, sgd or muon")


def adam_step_kernel(device_type: str, mixed_precision: bool, bf16_moments: bool = False) -> str:
    """What runs Adam's step, for the banner and `doctor`. `mixed_precision`: a `MixedPrecisionOptimizer`
    (--bf16, --fp16 or the distributed optimizer), whose step takes fusions/fused_adamw.py on CUDA.
    `bf16_moments`: a moment kept in bf16 (--use-precision-aware-optimizer), which torch's Adam cannot hold."""
    if mixed_precision and device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        kernel = "Adam(W) update and copy into the model params in one Triton kernel (fusions/fused_adamw.py)"
    elif bf16_moments:
        kernel = "Adam(W) in plain PyTorch (fusions/adamw_reference.py)"
    else:
        kernel = "torch Adam(W), foreach implementation" if device_type != "cuda" else "torch Adam(W), fused CUDA kernel"
    return f"{kernel}, bf16 moments" if bf16_moments else kernel


def _compute_dtype(config: OptimizerConfig) -> torch.dtype:
    return torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else torch.float32


def _grad_scaler(config: OptimizerConfig, device: torch.device) -> Optional[MegatronGradScaler]:
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
            device=device,
        )
    return None


def _build_optimizer(
    config: OptimizerConfig, param_groups: List[Dict], model_chunks: List[torch.nn.Module], is_expert_parallel: bool,
    name: str,
) -> MegatronOptimizer:
    """Wraps the `name` optimizer (adam, sgd, muon) over `param_groups` in the precision (or distributed) wrapper
    `config` asks for."""
    device = _params_device(param_groups)
    inner = _inner_optimizer(config, param_groups, device, name)
    if any(is_fully_sharded(param) for group in param_groups for param in group["params"]):
        return FullyShardedOptimizer(inner, config, _compute_dtype(config))
    if config.use_distributed_optimizer:
        buffer_attribute = "expert_parallel_buffers" if is_expert_parallel else "buffers"
        buffers = [buffer for chunk in model_chunks for buffer in getattr(chunk, buffer_attribute)]
        group_gloo = (
            parallel_state.get_expert_data_parallel_group_gloo()
            if is_expert_parallel
            else parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)
        )
        return DistributedOptimizer(inner, config, _grad_scaler(config, device), buffers, group_gloo)
    if not (config.fp16 or config.bf16):
        return FP32Optimizer(inner, config)
    return Float16OptimizerWithFloat16Params(inner, config, _grad_scaler(config, device))


def _check_distributed_optimizer_setup(config: OptimizerConfig, model_chunks: List[torch.nn.Module]) -> None:
    """The optimizer and DDP must agree on --use-distributed-optimizer: each needs what the other does."""
    ddp_configs = [getattr(chunk, "ddp_config", None) for chunk in model_chunks]
    sharded = [ddp_config is not None and ddp_config.use_distributed_optimizer for ddp_config in ddp_configs]
    if config.use_distributed_optimizer and not all(sharded):
        raise ValueError(
            "use_distributed_optimizer (--use-distributed-optimizer) needs every model chunk wrapped in "
            "DistributedDataParallel with DistributedDataParallelConfig(use_distributed_optimizer=True)"
        )
    if any(sharded) and not config.use_distributed_optimizer:
        raise ValueError(
            "the model's DistributedDataParallelConfig has use_distributed_optimizer=True (gradients are "
            "reduce-scattered, each rank keeps only its shard): set OptimizerConfig.use_distributed_optimizer too"
        )
    if config.use_distributed_optimizer and config.optimizer != "adam":
        raise ValueError(
            f"the distributed optimizer (--use-distributed-optimizer) supports --optimizer adam only, got "
            f"--optimizer {config.optimizer}"
        )


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable] = None,
    scale_lr_cond: Optional[Callable] = None,
    lr_mult: float = 1.0,
    mup_width_mult: Optional[float] = None,
) -> MegatronOptimizer:
    """The Megatron optimizer for the trainable params of `model_chunks` (one chunk per virtual stage).

    Param groups: no weight decay for biases and 1-D params (but the q/k layernorms' with
    `apply_wd_to_qk_layernorm`; or where `no_weight_decay_cond(name, param)`), `lr * lr_mult` where
    `scale_lr_cond(name, param)`, `decoupled_lr`/`decoupled_min_lr` for params marked
    `is_embedding_or_output_parameter`. Expert-parallel params (`allreduce=False`) get
    their own optimizer, whose statistics are reduced over the expert groups. With `mup_width_mult` (the model
    config's, under muP) the hidden and vector-like params get muP's learning rates and epsilon (mup.py).
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr (--lr) must be set to build the optimizer")
    if config.decoupled_min_lr is not None and config.decoupled_lr is None:
        raise ValueError("decoupled_min_lr (--decoupled-min-lr) needs decoupled_lr (--decoupled-lr)")
    _check_distributed_optimizer_setup(config, model_chunks)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logger.info("setting up optimizer with %s", config)

    if config.optimizer == "muon":
        mark_qkv_params(model_chunks)
    group_overrides = None if mup_width_mult is None else mup_group_overrides(config, mup_width_mult, is_muon_param)
    param_groups = get_param_groups(
        model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, config.decoupled_lr is not None,
        config.apply_wd_to_qk_layernorm, group_overrides,
    )
    if not param_groups:
        raise ValueError("get_megatron_optimizer: the model chunks have no trainable parameters")
    set_min_and_max_lr(param_groups, config.lr, config.min_lr, config.decoupled_lr, config.decoupled_min_lr)

    if config.optimizer == "muon":
        by_name = [("muon", _filtered(param_groups, is_muon_param)),
                   (config.muon_scalar_optimizer, _filtered(param_groups, lambda param: not is_muon_param(param)))]
    else:
        by_name = [(config.optimizer, param_groups)]
    optimizers = []
    for is_expert_parallel in (False, True):
        for name, groups in by_name:
            groups = [group for group in groups if group["is_expert_parallel"] == is_expert_parallel]
            if groups:
                optimizers.append(_build_optimizer(config, groups, model_chunks, is_expert_parallel, name))
                if is_expert_parallel:
                    _reduce_over_expert_groups(config, optimizers[-1])
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)


def _filtered(param_groups: List[Dict], keep: Callable) -> List[Dict]:
    """The groups with only the params `keep` accepts (groups left empty dropped)."""
    groups = [dict(group, params=[param for param in group["params"] if keep(param)]) for group in param_groups]
    return [group for group in groups if group["params"]]


def _reduce_over_expert_groups(config: OptimizerConfig, expert_optimizer: MegatronOptimizer) -> None:
    """An optimizer of expert-parallel params counts TP replicas and reduces its statistics over the expert groups."""
    if not parallel_state.model_parallel_is_initialized():
        return
    expert_optimizer.tensor_parallel_rank = parallel_state.get_expert_tensor_parallel_rank()
    # The distributed and the fully sharded optimizer reduce their statistics over all ranks already.
    if not (config.use_distributed_optimizer or isinstance(expert_optimizer, FullyShardedOptimizer)):
        expert_optimizer.grad_stats_parallel_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
