"""Checkpoint save/load flags."""

from dataclasses import dataclass

from megatron.core.dist_checkpointing.strictness import STRICT_HANDLING
from megatron.training.config.fields import Section, flag


@dataclass(kw_only=True)
class CheckpointingConfig(Section):
    """Where and how checkpoints are saved and loaded, and in which format."""

    TITLE = "checkpointing"

    save: str | None = None
    """Directory to save checkpoints to."""

    save_interval: int | None = flag(None, names=("--save-interval", "--persistent-save-interval"))
    """Iterations between checkpoint saves (required with --save)."""

    save_retain_interval: int | None = None
    """Keep only checkpoints on this interval (plus the latest); a multiple of --save-interval."""

    # Megatron gives these store_true flags a None default; code tests them for truth.
    no_save_optim: bool | None = flag(None, action="store_true")
    """Do not save the optimizer."""

    no_save_rng: bool | None = flag(None, action="store_true")
    """Do not save the RNG state."""

    load: str | None = None
    """Directory to load a checkpoint from."""

    no_load_optim: bool | None = flag(None, action="store_true")
    """Do not load the optimizer."""

    no_load_rng: bool | None = flag(None, action="store_true")
    """Do not load the RNG state."""

    finetune: bool = False
    """Load only the model: iteration 0, no optimizer or RNG state, counters reset."""

    pretrained_checkpoint: str | None = None
    """Checkpoint to start from when --load has none."""

    ckpt_step: int | None = None
    """Load this iteration instead of the latest."""

    perform_initialization: bool = flag(True, names=("--no-initialization",))
    """Skip weight initialisation (when a checkpoint will be loaded anyway)."""

    use_checkpoint_args: bool = False
    """Take the model-shape arguments from the checkpoint."""

    use_mp_args_from_checkpoint_args: bool = False
    """Take the model-parallel sizes from the checkpoint."""

    use_tokenizer_model_from_checkpoint_args: bool = flag(
        True, names=("--no-use-tokenizer-model-from-checkpoint-args",))
    """With --use-checkpoint-args, keep this command line's tokenizer model."""

    exit_on_missing_checkpoint: bool = False
    """Exit instead of initialising randomly when --load has no checkpoint."""

    ckpt_format: str = flag("torch_dist", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"))
    """Checkpoint format: torch_dist (sharded, loads under any TP/PP/DP layout; the default, as in
    Megatron-LM) or torch (one file per model-parallel rank)."""

    dist_ckpt_optim_fully_reshardable: bool = False
    """torch_dist with --use-distributed-optimizer: write the optimizer state per parameter (loads under any
    TP/PP/DP layout and into either optimizer) instead of per DDP bucket (loads only under the saving TP/PP
    layout)."""

    auto_detect_ckpt_format: bool = False
    """Detect the format of the checkpoint being loaded."""

    ckpt_convert_format: str | None = flag(None, choices=("torch", "torch_dist"))
    """Save the loaded checkpoint again in this format, under <--ckpt-convert-save>/<format>."""

    ckpt_convert_save: str | None = None
    """Where to save the converted checkpoint."""

    ckpt_fully_parallel_save: bool = flag(True, names=("--no-ckpt-fully-parallel-save",))
    """Do not spread distributed-checkpoint writes over data-parallel ranks."""

    ckpt_fully_parallel_load: bool = False
    """Spread distributed-checkpoint reads over data-parallel ranks."""

    async_save: bool | None = flag(None, action="store_true")
    """Write torch_dist checkpoints in the background."""

    dist_ckpt_strictness: str = flag("assume_ok_unexpected", choices=STRICT_HANDLING)
    """Key-mismatch policy when loading a torch_dist checkpoint (Megatron-Core's StrictHandling)."""

    non_persistent_save_interval: int | None = None
    """Iterations between non-persistent (rolling) saves."""

    non_persistent_ckpt_type: str | None = flag(None, choices=("global", "local", "in_memory"))
    """Kind of non-persistent checkpoint."""

    non_persistent_global_ckpt_dir: str | None = None
    """Directory of global non-persistent checkpoints."""

    def derived(self) -> dict:
        """A conversion (--ckpt-convert-format) has nothing to do without a checkpoint: it exits."""
        return {"exit_on_missing_checkpoint": self.exit_on_missing_checkpoint or self.ckpt_convert_format is not None}

    def validate(self) -> list[str]:
        problems = []
        if self.save is not None and self.save_interval is None:
            problems.append("--save needs --save-interval")
        if self.save_interval is not None and self.save_interval < 1:
            problems.append(f"--save-interval {self.save_interval} must be positive")
        if self.save_retain_interval is not None:
            if self.save_interval is None or self.save_retain_interval % self.save_interval:
                problems.append(f"--save-retain-interval {self.save_retain_interval} must be a multiple of "
                                f"--save-interval {self.save_interval}")
        if self.async_save and self.ckpt_format != "torch_dist":
            problems.append(f"--async-save needs --ckpt-format torch_dist (this run has --ckpt-format "
                            f"{self.ckpt_format})")
        if self.ckpt_convert_format is not None:
            missing = [flag_name for flag_name, value in (("--ckpt-convert-save", self.ckpt_convert_save),
                                                          ("--load", self.load)) if value is None]
            if missing:
                problems.append(f"--ckpt-convert-format {self.ckpt_convert_format} needs {' and '.join(missing)}: "
                                "the checkpoint under --load is saved again under <--ckpt-convert-save>/<format>")
        return problems
