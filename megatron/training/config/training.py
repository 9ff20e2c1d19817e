"""Batch size, run length, activation recomputation, exit conditions, evaluation and autoresume flags."""

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

    rampup_batch_size: list[int] | None = flag(None, nargs="*")
    """<start> <increment> <samples>: grow the global batch from <start> by <increment> over <samples>
    samples, e.g. 16 16 5859375."""

    step_batch_size_schedule: str | None = None
    """Step-wise global batch schedule, e.g. "0:16 2.4B:320"."""

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

    recompute_modules: list[str] | None = flag(None, nargs="*")
    """Submodules recomputed with selective granularity (default ["core_attn"])."""

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


@dataclass(kw_only=True)
class AutoresumeConfig(Section):
    """NVIDIA's ADLR cluster autoresume (refused: it needs the cluster's library)."""

    TITLE = "autoresume"

    adlr_autoresume: bool = False
    """Enable autoresume on NVIDIA's ADLR cluster."""

    adlr_autoresume_interval: int = 1000
    """Iterations between autoresume checks."""
