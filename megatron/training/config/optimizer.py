"""Optimizer, regularisation and learning-rate schedule flags.

The schedule counts samples, not iterations: iteration-valued flags are multiplied by the global batch
size when the scheduler is built (as Megatron-LM's `OptimizerParamScheduler`, which steps in samples).
"""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag

_STATE_DTYPE_FLAGS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


@dataclass(kw_only=True)
class OptimizerChoiceConfig(Section):
    """Which optimizer, and the precision its state is kept in."""

    TITLE = "optimizer"

    optimizer: str = flag("adam", choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"))
    """adam is AdamW (decoupled weight decay); sgd uses --sgd-momentum; muon updates the weight matrices with Muon
    (--muon-*) and the other params with AdamW; dist_muon is Megatron-LM's old name of --optimizer muon
    --use-distributed-optimizer."""

    optimizer_cpu_offload: bool = False
    """Keep the optimizer state on the host and step there (Megatron-LM's hybrid-device optimizer)."""

    use_precision_aware_optimizer: bool = False
    """Let the optimizer keep state in lower precision (Adam and --use-distributed-optimizer only); what is
    built: --exp-avg-dtype / --exp-avg-sq-dtype bf16, --main-grads-dtype bf16."""

    main_grads_dtype: str = flag("fp32", choices=("fp32", "bf16"))
    """dtype of the main gradients with --use-precision-aware-optimizer: bf16 (with --bf16) keeps the gradient
    buffers in bf16, accumulated and reduced in bf16 as with --grad-reduce-in-bf16, read by Adam as they are."""

    main_params_dtype: str = flag("fp32", choices=("fp32", "fp16"))
    """dtype of the main params with --use-precision-aware-optimizer (fp32 only so far)."""

    exp_avg_dtype: str = flag("fp32", choices=("fp32", "fp16", "bf16", "fp8"))
    """dtype Adam's first moment is stored in with --use-precision-aware-optimizer (fp32 or bf16 so far); the
    update itself computes in fp32."""

    exp_avg_sq_dtype: str = flag("fp32", choices=("fp32", "fp16", "bf16", "fp8"))
    """dtype Adam's second moment is stored in with --use-precision-aware-optimizer (fp32 or bf16 so far); the
    update itself computes in fp32."""

    def derived(self) -> dict:
        """The four state dtype flags as torch dtypes, as Megatron-LM's validation makes them."""
        # Imported here: the optimizer package loads the model code, which parsing alone does not need.
        from megatron.core.optimizer.optimizer_config import DTYPE_OF_NAME

        return {name: DTYPE_OF_NAME.get(getattr(self, name), getattr(self, name)) for name in _STATE_DTYPE_FLAGS}


@dataclass(kw_only=True)
class RegularizationConfig(Section):
    """Dropout, weight decay, gradient clipping and the optimizers' own constants."""

    TITLE = "regularization"

    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""

    hidden_dropout: float = 0.1
    """Dropout on hidden states."""

    weight_decay: float = 0.01
    """Weight decay (biases and 1-D parameters get none)."""

    apply_wd_to_qk_layernorm: bool = False
    """Give the per-head q/k layernorms weight decay too (the exception Qwen3-Next makes)."""

    start_weight_decay: float | None = None
    """Initial weight decay with a non-constant --weight-decay-incr-style."""

    end_weight_decay: float | None = None
    """Final weight decay with a non-constant --weight-decay-incr-style."""

    weight_decay_incr_style: str = flag("constant", choices=("constant", "linear", "cosine"))
    """How weight decay moves from --start-weight-decay to --end-weight-decay."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    muon_momentum: float = 0.9
    """Muon's momentum (with --optimizer muon)."""

    muon_split_qkv: bool = flag(True, names=("--muon-no-split-qkv",))
    """Orthogonalize the fused QKV weight whole instead of its query, key and value rows one by one."""

    muon_nesterov: bool = False
    """Nesterov momentum in Muon."""

    muon_scale_mode: str = flag("spectral", choices=("spectral", "unit_rms_norm", "shape_scaling"))
    """Scale of Muon's orthogonalized update of a [rows, cols] matrix: sqrt(max(rows, cols)), sqrt(rows / cols) or
    sqrt(max(1, rows / cols))."""

    muon_fp32_matmul_prec: str = flag("medium", choices=("low", "medium", "high"))
    """Precision of Muon's Newton-Schulz iterations: medium runs them in bf16, high in fp32 (TF32 on GPUs)."""

    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficients of Muon: simple, quintic, polar_express, cans, aol or deepseekv4."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations of Muon."""

    muon_tp_mode: str = flag("duplicated", choices=("blockwise", "duplicated", "distributed"))
    """How Muon orthogonalizes tensor-parallel shards: the gathered matrix (duplicated), through summed Gram
    matrices (distributed; both the update of one rank), or each shard alone (blockwise)."""

    muon_use_syrk: bool = False
    """Megatron-LM: compute Muon's Gram matrices with a Triton SYRK kernel. Here they are torch matmuls (the
    same products)."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's update."""

    muon_scalar_optimizer: str = flag("adam", choices=("adam", "lion"))
    """Optimizer of the params Muon leaves out (embeddings, output layer, norms, biases): adam (lion is not
    supported yet)."""

    def derived(self) -> dict:
        """With the constant style, the weight-decay ramp starts and ends at --weight-decay."""
        if self.weight_decay_incr_style == "constant":
            return {"start_weight_decay": self.weight_decay, "end_weight_decay": self.weight_decay}
        return {}

    def validate(self) -> list[str]:
        if self.weight_decay_incr_style == "constant":
            if {self.start_weight_decay, self.end_weight_decay} - {None, self.weight_decay}:
                return ["--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine; "
                        "with constant use --weight-decay"]
        elif self.start_weight_decay is None or self.end_weight_decay is None:
            return [f"--weight-decay-incr-style {self.weight_decay_incr_style} needs --start-weight-decay and "
                    f"--end-weight-decay"]
        return []


@dataclass(kw_only=True)
class LearningRateConfig(Section):
    """The learning-rate schedule: warmup, decay and its floor."""

    TITLE = "learning rate"

    lr: float | None = None
    """Peak learning rate."""

    lr_decay_style: str = flag("linear", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    """Learning-rate decay after warmup."""

    lr_wsd_decay_style: str = flag("exponential", choices=("exponential", "linear", "cosine", "minus_sqrt"))
    """Anneal shape of the WSD schedule."""

    lr_decay_iters: int | None = None
    """Iterations to decay over (default --train-iters)."""

    lr_decay_samples: int | None = None
    """Samples to decay over (default --train-samples)."""

    lr_wsd_decay_iters: int | None = None
    """Length of the WSD anneal, iterations."""

    lr_wsd_decay_samples: int | None = None
    """Length of the WSD anneal, samples."""

    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay steps; exclusive with --lr-warmup-iters/-samples."""

    lr_warmup_iters: int = 0
    """Linear warmup length, iterations."""

    lr_warmup_samples: int = 0
    """Linear warmup length, samples."""

    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""

    min_lr: float = 0.0
    """Floor of the decayed learning rate."""

    override_opt_param_scheduler: bool = flag(
        False, names=("--override-opt_param-scheduler", "--override-opt-param-scheduler"))
    """Take the schedule from these flags and ignore the one in the checkpoint."""

    use_checkpoint_opt_param_scheduler: bool = flag(
        False, names=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"))
    """Take the schedule from the checkpoint and ignore these flags."""

    decoupled_lr: float | None = None
    """Separate learning rate for the embedding and output layer."""

    decoupled_min_lr: float | None = None
    """Minimum learning rate for the embedding and output layer."""

    def validate(self) -> list[str]:
        problems = []
        if self.lr is not None and self.lr < 0:
            problems.append(f"--lr {self.lr} must be >= 0 (the optimizer steps against the gradient by --lr)")
        elif self.lr is not None and self.min_lr > self.lr:
            problems.append(f"--min-lr {self.min_lr} must be <= --lr {self.lr}")
        if self.min_lr < 0:
            problems.append(f"--min-lr {self.min_lr} must be >= 0")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            problems.append(f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1]")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None and self.lr_wsd_decay_samples is None:
            problems.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
        return problems
