"""Batch size, run length, activation recomputation, exit conditions, evaluation and autoresume flags."""

import signal
from dataclasses import dataclass

from megatron.training.config.fields import Section, flag

# Signal names accepted by --exit-signal; validation turns the name into a `signal.Signals`.
EXIT_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


@dataclass(kw_only=True)
class TrainingConfig(Section):
    """How much to train, in what batches, what to recompute, and when to stop."""

    TITLE = "training"

    micro_batch_size: int | None = None
    """Sequences per model replica per forward pass."""

    global_batch_size: int | None = None
    """Sequences per optimizer step = micro-batch-size x microbatches x data-parallel size (default
    micro-batch-size x data-parallel size: one microbatch)."""

    rampup_batch_size: list[int] | None = flag(None, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    """<start> <increment> <samples>: grow the global batch from <start> by <increment> over <samples>
    samples, e.g. 16 16 5859375."""

    step_batch_size_schedule: str | None = None
    """Global batch by consumed tokens, "THRESHOLD:BATCH ...", e.g. "0:384 200B:768 400B:1152" (thresholds with
    K/M/B/T suffixes, the first 0); replaces --global-batch-size."""

    decrease_batch_size_if_needed: bool = False
    """Shrink the global batch when micro-batch x data-parallel size does not divide it."""

    train_iters: int | None = None
    """Iterations to train over all runs; exclusive with --train-samples."""

    train_samples: int | None = None
    """Samples to train over all runs; exclusive with --train-iters."""

    recompute_activations: bool = False
    """Shorthand for --recompute-granularity selective."""

    recompute_granularity: str | None = flag(None, choices=("full", "selective"))
    """full: recompute whole layers (needs --recompute-method and --recompute-num-layers); selective:
    recompute --recompute-modules only."""

    recompute_method: str | None = flag(None, choices=("uniform", "block"))
    """uniform: checkpoint chunks of --recompute-num-layers layers; block: recompute the first
    --recompute-num-layers layers of each pipeline stage."""

    recompute_num_layers: int | None = None
    """Layers per recompute chunk (uniform) or per pipeline stage (block)."""

    recompute_modules: list[str] | None = flag(None, nargs="+")
    """Submodules recomputed with selective granularity (default core_attn): core_attn, mlp, layernorm (the
    input and pre-MLP norms), moe_act (the experts' activation, with --moe-grouped-gemm), mla_up_proj (the
    multi-latent up projections and RoPE)."""

    fine_grained_activation_offloading: bool = False
    """Keep what the --offload-modules save for backward in host memory (pinned, copied on a side stream)
    until backward needs it, instead of device memory."""

    offload_modules: list[str] = flag(default_factory=list, nargs="+")
    """Modules offloaded with --fine-grained-activation-offloading: attn_norm, qkv_linear, core_attn, attn_proj
    (with core_attn), mlp_norm, expert_fc1, moe_act."""

    min_offloaded_tensor_size: int = 1024 * 1024
    """Saved tensors of fewer elements are not offloaded."""

    fine_grained_offloading_max_inflight_offloads: int | None = None
    """At most this many forward calls of one offloaded module with copies in flight (0: wait for each copy);
    default: never wait."""

    activation_offload_fraction: float = 1.0
    """Fraction of the offload groups offloaded (only 1.0 is supported here)."""

    delta_offload_bytes_across_pp_ranks: int = 0
    """Bytes fewer offloaded per later pipeline rank (only 0 is supported here)."""

    delay_offload_until_cuda_graph: bool = False
    """Megatron-LM: start the offload copies of modules outside a per-layer CUDA graph after its replay."""

    distribute_saved_activations: bool = False
    """Shard recomputation checkpoints across the tensor-parallel group."""

    calculate_per_token_loss: bool = False
    """Normalise the loss by the global token count instead of per microbatch."""

    exit_interval: int | None = None
    """Save and exit when the iteration is a multiple of this value."""

    exit_duration_in_mins: int | None = None
    """Save and exit after this many minutes."""

    exit_signal_handler: bool = False
    """Save and exit when --exit-signal is received."""

    exit_signal: str = flag("SIGTERM", choices=EXIT_SIGNAL_NAMES)
    """Signal caught by --exit-signal-handler."""

    manual_gc: bool = False
    """Disable Python's automatic garbage collection and collect on a schedule."""

    manual_gc_interval: int = 0
    """Iterations between manual collections (0: none in training; evaluation still collects unless
    --no-manual-gc-eval)."""

    manual_gc_eval: bool = flag(True, names=("--no-manual-gc-eval",))
    """With --manual-gc, do not collect around evaluation."""

    empty_unused_memory_level: int = flag(0, choices=(0, 1, 2))
    """Call torch.cuda.empty_cache(): 0 never, 1 after the forward-backward pass, 2 also after the optimizer
    step."""

    use_cpu_initialization: bool | None = flag(None, action="store_true")
    """Initialise full weights on the CPU then split them (same init for every TP size)."""

    @property
    def effective_recompute_granularity(self) -> str | None:
        """--recompute-granularity, with the --recompute-activations shorthand for selective."""
        return "selective" if self.recompute_activations else self.recompute_granularity

    @property
    def effective_exit_signal(self) -> signal.Signals:
        """--exit-signal as a `signal.Signals` (a validated namespace already holds one)."""
        return signal.Signals[self.exit_signal] if isinstance(self.exit_signal, str) else self.exit_signal

    def derived(self) -> dict:
        return {"recompute_granularity": self.effective_recompute_granularity,
                "exit_signal": self.effective_exit_signal}

    def validate(self) -> list[str]:
        problems = self._batch_problems() + self._length_problems() + self._recompute_problems()
        if self.manual_gc_interval < 0:
            problems.append(f"--manual-gc-interval {self.manual_gc_interval} must be >= 0")
        return problems

    def _batch_problems(self) -> list[str]:
        problems = []
        if self.micro_batch_size is None:
            problems.append("--micro-batch-size is required")
        elif self.micro_batch_size < 1:
            problems.append(f"--micro-batch-size {self.micro_batch_size} must be positive")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            problems.append(f"--global-batch-size {self.global_batch_size} must be positive")
        if self.step_batch_size_schedule is not None:
            others = [name for name, given in (("--global-batch-size", self.global_batch_size is not None),
                                               ("--rampup-batch-size", self.rampup_batch_size is not None),
                                               ("--decrease-batch-size-if-needed", self.decrease_batch_size_if_needed))
                      if given]
            if others:
                problems.append(f"--step-batch-size-schedule sets the global batch: drop {', '.join(others)} "
                                "(Megatron-LM's rule)")
        if self.rampup_batch_size is not None:
            if len(self.rampup_batch_size) != 3:
                problems.append(f"--rampup-batch-size takes 3 values <start> <increment> <samples>, got "
                                f"{self.rampup_batch_size}")
            elif min(self.rampup_batch_size) < 1:
                problems.append(f"--rampup-batch-size {' '.join(map(str, self.rampup_batch_size))}: all values must "
                                "be positive")
        return problems

    def _length_problems(self) -> list[str]:
        problems = []
        iters, samples = self.train_iters, self.train_samples
        if iters is not None and samples is not None:
            problems.append(f"give --train-iters or --train-samples, not both (got {iters} and {samples})")
        if iters is not None and self.rampup_batch_size is not None:
            problems.append("--rampup-batch-size needs sample-based training: use --train-samples instead of "
                            "--train-iters")
        for flag_name, value in (("--train-iters", iters), ("--train-samples", samples)):
            if value is not None and value < 1:
                problems.append(f"{flag_name} {value} must be positive")
        return problems

    def _recompute_problems(self) -> list[str]:
        """The rules between the recompute flags alone; the layer counts are checked with the model's
        (Megatron-Core's `recompute_problems`)."""
        problems = []
        if self.recompute_activations and self.recompute_granularity not in (None, "selective"):
            problems.append(f"--recompute-activations means selective recompute, but --recompute-granularity "
                            f"{self.recompute_granularity} was given")
        if self.effective_recompute_granularity == "selective" and self.recompute_method is not None:
            problems.append("--recompute-method applies to --recompute-granularity full only, not selective")
        if self.distribute_saved_activations and self.effective_recompute_granularity != "full":
            problems.append("--distribute-saved-activations needs --recompute-granularity full")
        if not self.fine_grained_activation_offloading:
            given = [shown for shown, value, default in (
                ("--offload-modules", self.offload_modules, []),
                ("--min-offloaded-tensor-size", self.min_offloaded_tensor_size, 1024 * 1024),
                ("--fine-grained-offloading-max-inflight-offloads",
                 self.fine_grained_offloading_max_inflight_offloads, None)) if value != default]
            if given:
                problems.append(f"{', '.join(given)} need --fine-grained-activation-offloading (without it nothing "
                                "is offloaded)")
        return problems


@dataclass(kw_only=True)
class ValidationConfig(Section):
    """Evaluation on the validation set."""

    TITLE = "validation"

    eval_iters: int = 100
    """Iterations per evaluation."""

    # Megatron <= v0.15 defaulted to 1000; v0.16 and main to None: no evaluation during training, only the
    # one after it (the validation split then holds one evaluation's samples, data_iterators.py).
    eval_interval: int | None = None
    """Iterations between evaluations on the validation set (default: none during training, one evaluation
    after it)."""

    skip_train: bool = False
    """Skip training; only evaluate."""

    full_validation: bool = False
    """Evaluate on the whole validation set."""

    multiple_validation_sets: bool = False
    """Evaluate each validation dataset separately."""

    eval_micro_batch_size: int | None = None
    """Sequences per forward pass in evaluation (default --micro-batch-size)."""

    eval_global_batch_size: int | None = None
    """Sequences per evaluation iteration (default --global-batch-size); a multiple of
    --eval-micro-batch-size x data-parallel size."""

    def validate(self) -> list[str]:
        problems = []
        if self.eval_interval is not None and self.eval_interval < 1:
            problems.append(f"--eval-interval {self.eval_interval} must be positive")
        if self.eval_iters < 0:
            problems.append(f"--eval-iters {self.eval_iters} must be >= 0")
        for flag_name, size in (("--eval-micro-batch-size", self.eval_micro_batch_size),
                                ("--eval-global-batch-size", self.eval_global_batch_size)):
            if size is not None and size < 1:
                problems.append(f"{flag_name} {size} must be positive")
        return problems


@dataclass(kw_only=True)
class AutoresumeConfig(Section):
    """NVIDIA's ADLR cluster autoresume (refused: it needs the cluster's library)."""

    TITLE = "autoresume"

    adlr_autoresume: bool = False
    """Enable autoresume on NVIDIA's ADLR cluster."""

    adlr_autoresume_interval: int = 1000
    """Iterations between autoresume checks."""
