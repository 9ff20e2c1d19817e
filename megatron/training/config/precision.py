"""Mixed-precision flags, and the FP8/FP4 flags of Megatron's "Transformer-Engine" group."""

from dataclasses import dataclass

import torch

from megatron.training.config.fields import Section, flag


@dataclass(kw_only=True)
class MixedPrecisionConfig(Section):
    """fp16/bf16 training, loss scaling and the parts kept in fp32."""

    TITLE = "mixed precision"

    fp16: bool = False
    """Train in float16 with loss scaling."""

    bf16: bool = False
    """Train in bfloat16."""

    grad_reduce_in_bf16: bool = False
    """With --bf16, accumulate and reduce gradients in bf16 instead of fp32."""

    loss_scale: float | None = None
    """Static fp16 loss scale (default: dynamic scaling)."""

    initial_loss_scale: float = 2**32
    """Initial dynamic loss scale."""

    min_loss_scale: float = 1.0
    """Minimum dynamic loss scale."""

    loss_scale_window: float = 1000
    """Clean steps before the dynamic loss scale is doubled."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic loss scale is halved."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32 (with --fp16 or --bf16)."""

    apply_query_key_layer_scaling: bool = False
    """Scale Q.K^T by 1 / layer number (fp16 stability); implies --attention-softmax-in-fp32."""

    attention_softmax_in_fp32: bool = False
    """Run attention masking and softmax in fp32."""

    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and all-reduce gradients in fp32 (always on with --bf16 unless --grad-reduce-in-bf16)."""

    fp16_lm_cross_entropy: bool = False
    """Compute the unreduced LM cross-entropy in fp16 (with --fp16)."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' dtype: float16 with --fp16, bfloat16 with --bf16, else float32."""
        if self.fp16 and not self.bf16:
            return torch.float16
        return torch.bfloat16 if self.bf16 and not self.fp16 else torch.float32

    @property
    def dynamic_loss_scaling(self) -> bool:
        """fp16 without --loss-scale: an inf/nan gradient is then the scaler's signal, not an error."""
        return self.params_dtype == torch.float16 and not self.loss_scale

    def derived(self) -> dict:
        """The parameters' dtype, and --apply-query-key-layer-scaling implying --attention-softmax-in-fp32."""
        return {"params_dtype": self.params_dtype,
                "attention_softmax_in_fp32": self.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling,
                "accumulate_allreduce_grads_in_fp32": self.effective_accumulate_allreduce_grads_in_fp32}

    @property
    def effective_accumulate_allreduce_grads_in_fp32(self) -> bool:
        """With --bf16, gradients are accumulated and reduced in fp32 unless --grad-reduce-in-bf16 (or
        --main-grads-dtype bf16, an optimizer flag: arguments/derived.py applies that rule)."""
        if self.params_dtype == torch.bfloat16:
            return not self.grad_reduce_in_bf16
        return self.accumulate_allreduce_grads_in_fp32

    def validate(self) -> list[str]:
        problems = []
        if self.fp16 and self.bf16:
            problems.append("--fp16 and --bf16 are mutually exclusive")
        if self.grad_reduce_in_bf16 and not self.bf16:
            problems.append("--grad-reduce-in-bf16 needs --bf16")
        if self.fp16_lm_cross_entropy and not self.fp16:
            problems.append("--fp16-lm-cross-entropy needs --fp16")
        if self.fp32_residual_connection and not (self.fp16 or self.bf16):
            problems.append("--fp32-residual-connection needs --fp16 or --bf16")
        if self.loss_scale is not None and self.loss_scale <= 0:
            problems.append(f"--loss-scale {self.loss_scale} must be positive")
        return problems


@dataclass(kw_only=True)
class LowPrecisionConfig(Section):
    """FP8 and FP4 GEMMs."""

    TITLE = "fp8 / fp4"

    fp8: str | None = flag(None, names=("--fp8-format",), choices=("e4m3", "hybrid"))
    """FP8 format for GEMMs: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 backward)."""

    fp8_recipe: str = flag("delayed", choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"))
    """FP8 scaling recipe."""

    fp8_margin: int = 0
    """FP8 scaling margin."""

    fp8_interval: int = 1
    """Ignored (deprecated by Transformer Engine v1.8; Megatron-LM ignores it too)."""

    fp8_amax_history_len: int = 1
    """Length of the amax history."""

    fp8_amax_compute_algo: str = flag("most_recent", choices=("most_recent", "max"))
    """How the scale is computed from the amax history."""

    fp8_wgrad: bool = flag(True, names=("--no-fp8-wgrad",))
    """Compute weight gradients in higher precision in FP8 runs."""

    fp8_param_gather: bool = False
    """Keep parameters in FP8 and all-gather them in FP8."""

    first_last_layers_bf16: bool = False
    """Keep the first and last layers in bf16 during FP8 training."""

    num_layers_at_start_in_bf16: int = 1
    """Leading layers kept in bf16 with --first-last-layers-bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Trailing layers kept in bf16 with --first-last-layers-bf16."""

    fp4: str | None = flag(None, names=("--fp4-format",), choices=("e2m1",))
    """FP4 format for GEMMs."""

    fp4_recipe: str = flag("nvfp4", choices=("nvfp4", "custom"))
    """FP4 scaling recipe."""

    fp4_param_gather: bool = False
    """Keep parameters in FP4 and all-gather them in FP4."""

    te_rng_tracker: bool = False
    """Use Transformer Engine's random-number tracker."""

    def validate(self) -> list[str]:
        if self.fp8 is None:
            if self.first_last_layers_bf16:
                return ["--first-last-layers-bf16 needs --fp8-format (it keeps layers out of FP8 training)"]
            return []
        problems = []
        if self.fp8_amax_history_len < 1:
            problems.append(f"--fp8-amax-history-len {self.fp8_amax_history_len} must be >= 1")
        delayed_only = (self.fp8_amax_history_len, self.fp8_amax_compute_algo) != (1, "most_recent")
        if self.fp8_recipe == "tensorwise" and delayed_only:
            problems.append(f"--fp8-amax-history-len {self.fp8_amax_history_len} / --fp8-amax-compute-algo "
                            f"{self.fp8_amax_compute_algo} belong to --fp8-recipe delayed: tensorwise scales each "
                            "tensor by its own amax")
        return problems
