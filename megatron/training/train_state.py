"""The counters of a training run: what a checkpoint records besides the tensors so that a resumed run goes on
exactly where the saved one stopped.

    counter                               where a Megatron checkpoint keeps it
    iteration                             `iteration` (`total_iters` in very old files)
    consumed_train_samples                `args.consumed_train_samples`: the data sampler resumes there
    skipped_train_samples                 `args.skipped_train_samples`
    consumed_valid_samples                `args.consumed_valid_samples`: the validation sampler resumes there
    num_floating_point_operations_so_far  `num_floating_point_operations_so_far`

The training loop owns one `TrainState` and advances it; `publish` mirrors the sample and FLOP counters into
the argparse namespace, where Megatron-LM keeps them up to date (code written against it reads
`get_args().consumed_train_samples`, ...) and from where a checkpoint's `args` entry records them.
`args.iteration` is, in Megatron-LM, the iteration the run started (resumed) at: the Trainer writes it once.
"""

from dataclasses import asdict, dataclass, fields

from megatron.training.batch_plan import BatchPlan

# The counters Megatron-LM stores inside the checkpoint's `args`.
ARGS_COUNTERS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
# What Megatron-LM keeps up to date in `args` during the run.
LIVE_IN_ARGS = (*ARGS_COUNTERS, "num_floating_point_operations_so_far")


def checkpoint_iteration(state_dict: dict, checkpoint_name: str) -> int:
    """The iteration a checkpoint file records."""
    for key in ("iteration", "total_iters"):  # `total_iters` in very old checkpoints
        if key in state_dict:
            return state_dict[key]
    raise ValueError(f"checkpoint {checkpoint_name} records no iteration ('iteration' key)")


@dataclass
class TrainState:
    """The run's counters (module docstring)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_floating_point_operations_so_far: float = 0

    def state_dict(self) -> dict:
        """The counters under Megatron's names."""
        return asdict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Sets every counter from `state_dict` (as `state_dict()` returns it); a missing one is an error."""
        missing = [field.name for field in fields(self) if field.name not in state_dict]
        if missing:
            raise KeyError(f"train state without {', '.join(missing)}")
        for field in fields(self):
            setattr(self, field.name, state_dict[field.name])

    @classmethod
    def from_checkpoint(cls, state_dict: dict, iteration: int, plan: BatchPlan,
                        restore_counters: bool = True) -> "TrainState":
        """The counters a loaded checkpoint file holds (its `args` entry, where Megatron keeps the sample
        counters, may be absent). `iteration` is the one to resume at (0 for a release checkpoint or a
        fine-tune). Without `restore_counters` (a fine-tune) the sample counters start at 0.

        A checkpoint that predates the consumed-samples counter (none recorded, or 0 after some
        iterations) consumed `iteration` global batches of this run's `plan` (Megatron's rule)."""
        state = cls(iteration=iteration,
                    num_floating_point_operations_so_far=state_dict.get("num_floating_point_operations_so_far", 0))
        if restore_counters:
            checkpoint_args = state_dict.get("args")
            for name in ARGS_COUNTERS:
                setattr(state, name, getattr(checkpoint_args, name, 0))
            if state.consumed_train_samples == 0:
                state.consumed_train_samples = plan.samples(iteration)
        return state

    def publish(self, args) -> None:
        """Mirrors the sample and FLOP counters into `args` (module docstring); nothing in the training loop
        reads them back."""
        for name in LIVE_IN_ARGS:
            setattr(args, name, getattr(self, name))
