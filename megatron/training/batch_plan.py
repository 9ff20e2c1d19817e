"""The batch arithmetic of a run, in one place.

Every optimizer step trains one global batch, cut into microbatches on each data-parallel rank:

    global batch = micro batch size x data-parallel size x number of microbatches

Without --global-batch-size a step is one microbatch (global batch = micro batch x DP). The sizes must
divide: micro batch x DP divides the global batch (unless --decrease-batch-size-if-needed), the evaluation
batch and every step of the ramp-up (`size_problems`, reported by the argument validation).

With `--rampup-batch-size START INCR SAMPLES` the global batch grows with the samples consumed
(`ramped_global_batch_size` in megatron/core/num_microbatches_calculator.py); with `--step-batch-size-schedule`
it steps at token thresholds (`step_global_batch_size` there), and the plain global batch is micro batch x
data-parallel size, as Megatron-LM sets it, for what is counted in global batches (scheduler lengths given in
iterations, evaluation); with `--decrease-batch-size-if-needed` a global batch that is no whole number of
microbatches is rounded down (the "running" global batch size, the one trained and counted). Derived from these:

    iterations for --train-samples    walk the ramp until it ends, then whole global batches (the last
                                      partial one dropped), as Megatron's `update_train_iters`; a step
                                      schedule is walked to the end, its last step counted even if partial
    samples of N iterations           N x global batch (scheduler lengths, evaluation passes, dataset sizes,
                                      checkpoints that predate the consumed-samples counter)
    dataset sizes                     train: --train-samples or iterations x global batch; validation:
                                      (iterations // --eval-interval + 1) x --eval-iters x evaluation
                                      global batch; test: --eval-iters x evaluation global batch
                                      (Megatron's `get_train_valid_test_num_samples`)
    evaluation passes                 --eval-global-batch-size in micro batches of --eval-micro-batch-size
                                      (each defaults to its training counterpart)

Megatron code reads the current values through `get_num_microbatches()` and friends: `install` builds that
calculator from this plan, and the training loop moves it with the consumed samples.
"""

from dataclasses import dataclass

from megatron.core.num_microbatches_calculator import (
    init_num_microbatches_calculator,
    num_microbatches_for,
    parse_step_batch_size_schedule,
    ramped_global_batch_size,
    step_global_batch_size,
    update_num_microbatches,
)


@dataclass(frozen=True)
class StepBatch:
    """The batch of one optimizer step."""

    global_batch_size: int  # what the schedule asks for at this point of the ramp-up
    running_global_batch_size: int  # what is trained: rounded down under --decrease-batch-size-if-needed
    num_microbatches: int  # per data-parallel rank


@dataclass(frozen=True)
class BatchPlan:
    """Micro batch, data-parallel size, global batch and its ramp-up or step schedule (module docstring)."""

    micro_batch_size: int
    data_parallel_size: int
    global_batch_size: int
    rampup_batch_size: tuple | None = None  # (start, increment, ramp-up samples)
    decrease_batch_size_if_needed: bool = False
    eval_micro_batch_size: int | None = None  # --eval-micro-batch-size (None: the training micro batch)
    eval_global_batch_size: int | None = None  # --eval-global-batch-size (None: the training global batch)
    step_batch_size_schedule: tuple | None = None  # ((threshold in samples, global batch), ...)

    @classmethod
    def from_args(cls, args, data_parallel_size: int | None = None) -> "BatchPlan":
        """The plan of the arguments (validated ones, or the values being validated: an unset global batch is
        then one microbatch per step); `data_parallel_size` defaults to the one validation derived."""
        rampup = None if args.rampup_batch_size is None else tuple(int(value) for value in args.rampup_batch_size)
        data_parallel_size = data_parallel_size if data_parallel_size is not None else args.data_parallel_size
        global_batch_size = args.global_batch_size
        if global_batch_size is None:
            global_batch_size = args.micro_batch_size * data_parallel_size
        return cls(
            micro_batch_size=args.micro_batch_size,
            data_parallel_size=data_parallel_size,
            global_batch_size=global_batch_size,
            rampup_batch_size=rampup,
            decrease_batch_size_if_needed=bool(args.decrease_batch_size_if_needed),
            eval_micro_batch_size=args.eval_micro_batch_size,
            eval_global_batch_size=args.eval_global_batch_size,
            step_batch_size_schedule=None if args.step_batch_size_schedule is None else tuple(
                parse_step_batch_size_schedule(args.step_batch_size_schedule, args.seq_length)),
        )

    @property
    def samples_per_microbatch(self) -> int:
        """Samples of one microbatch over all data-parallel ranks: micro batch x DP."""
        return self.micro_batch_size * self.data_parallel_size

    @property
    def whole_microbatches(self) -> bool:
        """Whether the global batch is a whole number of microbatches (micro batch x DP divides it)."""
        return self.global_batch_size % self.samples_per_microbatch == 0

    @property
    def num_microbatches(self) -> int:
        """Microbatches of the full global batch (the dry run, the memory estimate)."""
        return self.global_batch_size // self.samples_per_microbatch

    @property
    def eval_micro(self) -> int:
        """The micro batch of evaluation passes."""
        return self.eval_micro_batch_size or self.micro_batch_size

    @property
    def eval_global(self) -> int:
        """The global batch of one evaluation iteration."""
        return self.eval_global_batch_size or self.global_batch_size

    @property
    def eval_num_microbatches(self) -> int:
        """Microbatches of one evaluation iteration per data-parallel rank."""
        return self.eval_global // (self.eval_micro * self.data_parallel_size)

    def size_problems(self, data_parallel: str) -> list[str]:
        """What does not divide (module docstring), one message each; `data_parallel` describes the
        data-parallel size in them (how it follows from the world size)."""
        problems = []
        per_microbatch = self.samples_per_microbatch
        if not (self.whole_microbatches or self.decrease_batch_size_if_needed):
            problems.append(f"global batch size {self.global_batch_size} is not a multiple of micro batch size "
                            f"{self.micro_batch_size} x {data_parallel}; nearest valid: "
                            f"{_nearest_multiples(self.global_batch_size, per_microbatch)}")
        eval_micro, eval_global = self.eval_micro_batch_size, self.eval_global_batch_size
        if None not in (eval_micro, eval_global) and min(eval_micro, eval_global) >= 1:
            eval_per_microbatch = eval_micro * self.data_parallel_size
            if eval_global % eval_per_microbatch:
                problems.append(f"--eval-global-batch-size {eval_global} is not a multiple of --eval-micro-batch-size "
                                f"{eval_micro} x {data_parallel}; nearest valid: "
                                f"{_nearest_multiples(eval_global, eval_per_microbatch)}")
        if self.rampup_batch_size is None or len(self.rampup_batch_size) != 3 or min(self.rampup_batch_size) < 1:
            return problems  # a malformed ramp-up is the training section's to report
        start, increment, _ = self.rampup_batch_size
        gbs = self.global_batch_size
        if start > gbs or (gbs - start) % increment:
            problems.append(f"--rampup-batch-size: --global-batch-size {gbs} - start {start} = {gbs - start} must "
                            f"be a non-negative multiple of the increment {increment}")
        if not self.decrease_batch_size_if_needed:
            # Step 0 is `start`, step 1 is `start + increment`: both multiples iff each one is.
            steps = (("start", start), ("increment", increment)) if start < gbs else (("start", start),)
            for name, value in steps:
                if value % per_microbatch:
                    problems.append(f"--rampup-batch-size {name} {value} is not a multiple of micro batch size "
                                    f"{self.micro_batch_size} x {data_parallel}")
        return problems

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size once `consumed_samples` training samples were consumed."""
        if self.step_batch_size_schedule is not None:
            return step_global_batch_size(consumed_samples, self.step_batch_size_schedule)
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        return ramped_global_batch_size(consumed_samples, self.global_batch_size, start, increment, ramp_samples)

    def step_batch(self, consumed_samples: int) -> StepBatch:
        """The batch of the step that starts after `consumed_samples` training samples."""
        global_batch_size = self.global_batch_size_at(consumed_samples)
        num_microbatches, running = num_microbatches_for(
            global_batch_size, self.micro_batch_size, self.data_parallel_size, self.decrease_batch_size_if_needed
        )
        return StepBatch(global_batch_size, running, num_microbatches)

    def samples(self, iterations: int) -> int:
        """Samples of `iterations` full global batches."""
        return iterations * self.global_batch_size

    def train_iters(self, train_samples: int) -> int:
        """Iterations that consume `train_samples` (module docstring): the ramp walked step by step (the step
        that crosses its end included), then whole global batches."""
        iterations = consumed = 0
        if self.step_batch_size_schedule is not None:
            while consumed < train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
            return iterations
        if self.rampup_batch_size is not None:
            ramp_samples = self.rampup_batch_size[2]
            while consumed <= ramp_samples and consumed <= train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def dataset_sizes(self, train_iters: int, train_samples: int | None, eval_interval: int | None,
                      eval_iters: int) -> tuple[int, int, int]:
        """(train, validation, test) samples the datasets must hold at least (module docstring)."""
        train = train_samples if train_samples else self.samples(train_iters)
        evaluations = train_iters // eval_interval + 1 if eval_interval else 1
        return train, evaluations * eval_iters * self.eval_global, eval_iters * self.eval_global

    def install(self, rank: int) -> None:
        """Builds the process-wide calculator that `get_num_microbatches()` reads (and checks every batch size
        the ramp-up can reach: a bad one raises here, before anything is built)."""
        init_num_microbatches_calculator(
            rank, None if self.rampup_batch_size is None else list(self.rampup_batch_size), self.global_batch_size,
            self.micro_batch_size, self.data_parallel_size, self.decrease_batch_size_if_needed,
            None if self.step_batch_size_schedule is None else " ".join(
                f"{threshold}:{batch_size}" for threshold, batch_size in self.step_batch_size_schedule),
        )

    def move_calculator(self, consumed_samples: int, verbose: bool = False) -> None:
        """Moves the process-wide calculator (`install`) to `consumed_samples`, for Megatron code that reads
        the current batch through it."""
        update_num_microbatches(consumed_samples, consistency_check=False, verbose=verbose)


def _nearest_multiples(value: int, step: int) -> str:
    """The multiples of `step` around `value`, for a message."""
    below = value // step * step
    return f"{below} or {below + step}" if below > 0 else str(step)
