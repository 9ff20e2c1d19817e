"""Console, TensorBoard, Weights & Biases, timer and profiler flags."""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag


@dataclass(kw_only=True)
class LoggingConfig(Section):
    """What is logged where, the timers, and the profilers."""

    TITLE = "logging"

    log_interval: int = 100
    """Iterations between log lines."""

    tensorboard_dir: str | None = None
    """Write TensorBoard events here."""

    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard writes."""

    tensorboard_queue_size: int = 1000
    """Pending TensorBoard events before a flush."""

    log_timers_to_tensorboard: bool = False
    """Write timers to TensorBoard."""

    log_learning_rate_to_tensorboard: bool = flag(True, names=("--no-log-learning-rate-to-tensorboard",))
    """Do not write the learning rate to TensorBoard."""

    log_loss_scale_to_tensorboard: bool = flag(True, names=("--no-log-loss-scale-to-tensorboard",))
    """Do not write the loss scale to TensorBoard."""

    log_validation_ppl_to_tensorboard: bool = False
    """Write validation perplexity to TensorBoard."""

    log_memory_to_tensorboard: bool = False
    """Write CUDA memory statistics to TensorBoard."""

    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard."""

    log_params_norm: bool = False
    """Log the L2 norm of the parameters."""

    log_num_zeros_in_grad: bool = False
    """Log the number of zero gradients."""

    log_throughput: bool = False
    """Log TFLOP/s per GPU."""

    log_progress: bool = False
    """Append tokens and FLOPs so far to progress.txt in the save directory."""

    timing_log_level: int = flag(0, choices=(0, 1, 2))
    """0: iteration time only; 1: also once-per-iteration timers; 2: all timers."""

    timing_log_option: str = flag("minmax", choices=("max", "minmax", "all"))
    """Report the max, the min and max, or every rank's time."""

    barrier_with_L1_time: bool = flag(True, names=("--no-barrier-with-level-1-timing",))
    """Do not put a barrier before level-1 timers."""

    wandb_project: str | None = None
    """Weights & Biases project (off if unset)."""

    wandb_exp_name: str | None = None
    """Weights & Biases run name."""

    wandb_save_dir: str | None = None
    """Local Weights & Biases directory."""

    wandb_entity: str | None = None
    """Weights & Biases entity."""

    logging_level: int | None = None
    """Level of the Python logging module."""

    profile: bool = False
    """Profile iterations --profile-step-start to --profile-step-end - 1: with nsys through
    cudaProfilerStart/Stop (nsys profile --capture-range=cudaProfilerApi), or with torch.profiler given
    --use-pytorch-profiler."""

    profile_step_start: int = 10
    """First profiled iteration."""

    profile_step_end: int = 12
    """Iteration where profiling stops."""

    use_pytorch_profiler: bool = False
    """With --profile: torch.profiler, a Chrome trace per rank in <tensorboard-dir>/../torch_profile/ and a
    kernel-time summary on the console."""

    pytorch_profiler_collect_shapes: bool = False
    """--use-pytorch-profiler records each op's input shapes (`record_shapes`)."""

    pytorch_profiler_collect_callstack: bool = False
    """--use-pytorch-profiler records the Python call stack of each op (`with_stack`): the trace then names the
    line that launched each kernel."""

    profile_ranks: list[int] = flag(default_factory=list, nargs="+")
    """Global ranks to profile (and to record memory history on); none given: all ranks."""

    record_memory_history: bool = False
    """Record the CUDA allocator's history from start-up and dump it at every logged iteration (and on
    out-of-memory) to --memory-snapshot-path, per rank."""

    memory_snapshot_path: str = "snapshot.pickle"
    """Where --record-memory-history writes its snapshot (<base>_<rank><ext>)."""

    def validate(self) -> list[str]:
        problems = []
        if self.log_interval < 1:
            problems.append(f"--log-interval {self.log_interval} must be positive")
        if self.profile and self.profile_step_end <= self.profile_step_start:
            problems.append(f"--profile-step-end {self.profile_step_end} must be above --profile-step-start "
                            f"{self.profile_step_start} (iterations start to end - 1 are profiled)")
        return problems
