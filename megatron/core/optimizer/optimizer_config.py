"""`OptimizerConfig`: every setting of the Megatron optimizer, with Megatron-Core's field names and defaults.

The training layer fills it from `--lr`, `--weight-decay`, `--adam-beta1`, `--clip-grad`, `--fp16`,
`--loss-scale`, ... (one field per flag, same name with dashes turned into underscores).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .muon import muon_option_problems

SUPPORTED_OPTIMIZERS = ("adam", "sgd", "muon")

# The values of --main-grads-dtype, --main-params-dtype, --exp-avg-dtype and --exp-avg-sq-dtype, as Megatron-LM
# maps them (fp8 state is stored as uint8).
DTYPE_OF_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPE_OF_NAME.items()}
# field: the dtypes built for it under --use-precision-aware-optimizer
_PRECISION_AWARE_BUILT = {
    "main_grads_dtype": (torch.float32, torch.bfloat16),
    "main_params_dtype": (torch.float32,),
    "exp_avg_dtype": (torch.float32, torch.bfloat16),
    "exp_avg_sq_dtype": (torch.float32, torch.bfloat16),
}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def precision_aware_problems(config) -> List[str]:
    """What is wrong with the precision-aware settings of `config`: an `OptimizerConfig`, or the validated
    command line (its fields have the same names). As Megatron-LM: the precision-aware optimizer needs Adam and
    the distributed optimizer, and without it every dtype must be fp32; and what is not built yet."""
    problems = []
    dtypes = {field: getattr(config, field) for field in _PRECISION_AWARE_BUILT}
    if not config.use_precision_aware_optimizer:
        for field, dtype in dtypes.items():
            if dtype != torch.float32:
                problems.append(f"{field} ({_flag(field)} {_NAME_OF_DTYPE.get(dtype, dtype)}) can only be fp32 when "
                                "not using the precision-aware optimizer (--use-precision-aware-optimizer)")
        return problems
    if config.optimizer != "adam":
        problems.append(f"use_precision_aware_optimizer (--use-precision-aware-optimizer) is only supported with "
                        f"adam, got optimizer {config.optimizer!r} (--optimizer {config.optimizer})")
    if not config.use_distributed_optimizer:
        problems.append("use_precision_aware_optimizer (--use-precision-aware-optimizer) is only supported with the "
                        "distributed optimizer (--use-distributed-optimizer)")
    if dtypes["main_grads_dtype"] == torch.bfloat16:
        if not getattr(config, "bf16", False):
            problems.append("main_grads_dtype (--main-grads-dtype bf16) needs --bf16")
        elif getattr(config, "accumulate_allreduce_grads_in_fp32", False):
            problems.append("--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set")
    for field, dtype in dtypes.items():
        built = _PRECISION_AWARE_BUILT[field]
        if dtype not in built:
            problems.append(f"{field} ({_flag(field)} {_NAME_OF_DTYPE.get(dtype, dtype)}) is not supported yet; "
                            f"use {' or '.join(_NAME_OF_DTYPE[choice] for choice in built)}")
    return problems


@dataclass
class OptimizerConfig:
    """Configuration of `get_megatron_optimizer` and the optimizer wrappers."""

    # --- general -------------------------------------------------------------------------------------
    optimizer: str = "adam"
    """`adam` (AdamW when `decoupled_weight_decay`, the default), `sgd`, or `muon` (Muon for the weight matrices,
    AdamW for the rest: muon.py)."""

    lr: Optional[float] = None
    """Peak learning rate (`--lr`); the scheduler warms up to it and decays from it."""

    min_lr: Optional[float] = None
    """Floor of the decayed learning rate (`--min-lr`); None means 0.0."""

    decoupled_lr: Optional[float] = None
    """Separate peak learning rate for the input embedding and output layer (`--decoupled-lr`)."""

    decoupled_min_lr: Optional[float] = None
    """Floor for the decoupled learning rate (`--decoupled-min-lr`); None means `min_lr`."""

    weight_decay: float = 0.01
    """Weight-decay coefficient; biases and 1-D parameters (norm weights) get none."""

    apply_wd_to_qk_layernorm: bool = False
    """Give the per-head q/k layernorm params (`q_layernorm.`, `k_layernorm.`) weight decay, the exception
    Qwen3-Next makes to "no weight decay on biases and 1-D params"."""

    # --- precision -----------------------------------------------------------------------------------
    fp16: bool = False
    """Train with fp16 parameters, fp32 main parameters and dynamic (or `loss_scale`) loss scaling."""

    bf16: bool = False
    """Train with bf16 parameters and fp32 main parameters (no loss scaling unless `loss_scale`)."""

    params_dtype: torch.dtype = torch.float32
    """dtype the model parameters were created in."""

    # --- loss scaling (fp16) -------------------------------------------------------------------------
    loss_scale: Optional[float] = None
    """Static loss scale; None selects dynamic loss scaling under fp16."""

    initial_loss_scale: float = 2**32
    """Starting value of the dynamic loss scale."""

    min_loss_scale: float = 1.0
    """The dynamic loss scale never drops below this."""

    loss_scale_window: float = 1000
    """Clean (overflow-free) steps before the dynamic loss scale doubles."""

    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic loss scale halves."""

    # --- Adam / SGD ----------------------------------------------------------------------------------
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-08
    """Adam's denominator term."""

    decoupled_weight_decay: bool = True
    """AdamW (decoupled weight decay) when True; L2-regularised Adam when False."""

    sgd_momentum: float = 0.9
    """Momentum of SGD."""

    # --- Muon (muon.py) -------------------------------------------------------------------------------
    muon_momentum: float = 0.95
    """Muon's momentum (`--muon-momentum`, default 0.9 there)."""

    muon_split_qkv: bool = True
    """Orthogonalize the query, key and value rows of the fused QKV weight one by one (`--muon-no-split-qkv`)."""

    muon_nesterov: bool = False
    """Nesterov momentum (`--muon-nesterov`)."""

    muon_scale_mode: str = "spectral"
    """Scale of the orthogonalized update: spectral, unit_rms_norm or shape_scaling (`--muon-scale-mode`)."""

    muon_fp32_matmul_prec: str = "medium"
    """Newton-Schulz precision: medium (bf16 iterations) or high (fp32) (`--muon-fp32-matmul-prec`)."""

    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficient set (`--muon-coefficient-type`)."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations (`--muon-num-ns-steps`)."""

    muon_tp_mode: str = "duplicated"
    """How tensor-parallel shards are orthogonalized: duplicated, distributed or blockwise (`--muon-tp-mode`)."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on the orthogonalized update (`--muon-extra-scale-factor`)."""

    muon_scalar_optimizer: str = "adam"
    """Optimizer of the params Muon leaves out (`--muon-scalar-optimizer`): adam only so far."""

    # --- distributed optimizer -----------------------------------------------------------------------
    use_distributed_optimizer: bool = False
    """Shard the fp32 main params and Adam state over data-parallel ranks (`--use-distributed-optimizer`)."""

    overlap_param_gather_with_optimizer_step: bool = False
    """Overlap the first parameter all-gather with the optimizer step: not supported yet."""

    # --- precision-aware optimizer -------------------------------------------------------------------
    use_precision_aware_optimizer: bool = False
    """Let the optimizer keep its state in lower precision (`--use-precision-aware-optimizer`; Adam and the
    distributed optimizer only). Built: the Adam moments in bf16 (`exp_avg_dtype`, `exp_avg_sq_dtype`), bf16
    main gradients (`main_grads_dtype`)."""

    main_grads_dtype: torch.dtype = torch.float32
    """dtype of the gradients the optimizer reads, under the precision-aware optimizer (`--main-grads-dtype`,
    with `--bf16`): fp32, or bf16, where DDP's grad buffers hold bf16 (`grad_reduce_in_fp32=False`: gradients
    accumulated and reduced in bf16, as Megatron-LM makes them for this flag) and the fused AdamW reads them as
    they are, into fp32."""

    main_params_dtype: torch.dtype = torch.float32
    """dtype of the main params under the precision-aware optimizer (`--main-params-dtype`): fp32 only so far."""

    exp_avg_dtype: torch.dtype = torch.float32
    """dtype Adam's first moment is stored in (`--exp-avg-dtype`): fp32, or bf16 with the precision-aware
    optimizer (updated in fp32, rounded to nearest when stored)."""

    exp_avg_sq_dtype: torch.dtype = torch.float32
    """dtype Adam's second moment is stored in (`--exp-avg-sq-dtype`): as `exp_avg_dtype`."""

    # --- miscellaneous -------------------------------------------------------------------------------
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 turns clipping off (the norm is still reported)."""

    log_num_zeros_in_grad: bool = False
    """Count the zero entries of the gradients at every step (`--log-num-zeros-in-grad`)."""

    barrier_with_L1_time: bool = False
    """Put a barrier before each level-1 optimizer timer, so the timings do not include waiting."""

    timers: Optional[Callable] = None
    """A `megatron.core.timers.Timers` to time the optimizer phases with, or None."""

    def __post_init__(self):
        problems = []
        if self.optimizer not in SUPPORTED_OPTIMIZERS:
            problems.append(
                f"optimizer {self.optimizer!r} is not supported yet; choose one of {', '.join(SUPPORTED_OPTIMIZERS)}"
            )
        if self.fp16 and self.bf16:
            problems.append("fp16 and bf16 are mutually exclusive (--fp16 / --bf16): pick one")
        if self.overlap_param_gather_with_optimizer_step:
            problems.append(
                "overlap_param_gather_with_optimizer_step (--overlap-param-gather-with-optimizer-step) "
                "is not supported yet"
            )
        if self.loss_scale is not None and self.loss_scale <= 0:
            problems.append(f"loss_scale (--loss-scale) must be positive, got {self.loss_scale}")
        if self.clip_grad < 0:
            problems.append(f"clip_grad (--clip-grad) must be >= 0 (0 disables clipping), got {self.clip_grad}")
        problems.extend(precision_aware_problems(self))
        if self.optimizer == "muon":
            problems.extend(muon_option_problems(self.muon_fp32_matmul_prec, self.muon_coefficient_type,
                                                 self.muon_num_ns_steps, self.muon_scale_mode, self.muon_tp_mode))
            if self.fp16:
                problems.append("optimizer muon with fp16 is not supported (as in Megatron-LM): use bf16")
            if self.muon_scalar_optimizer != "adam":
                problems.append(f"muon_scalar_optimizer (--muon-scalar-optimizer) {self.muon_scalar_optimizer} is "
                                "not supported yet; use adam")
        if problems:
            raise ValueError("invalid OptimizerConfig: " + "; ".join(problems))
