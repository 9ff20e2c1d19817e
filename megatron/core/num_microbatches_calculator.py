"""How many microbatches make one global batch, with an optional batch-size ramp-up or step schedule.

Every step trains

    global batch = micro batch size x number of microbatches x data-parallel size

so the number of microbatches is global_batch / (micro_batch x dp) and must be a whole number. With
`--rampup-batch-size START INCR SAMPLES` the global batch grows from START by INCR in
(GBS - START) / INCR equal increments spread over SAMPLES consumed samples:

    current(consumed) = GBS                                            if consumed > SAMPLES
                        START + int(consumed / (SAMPLES / increments)) * INCR   otherwise

e.g. `--rampup-batch-size 16 16 5859375 --global-batch-size 1536`: 95 increments of 16, one every
61677.6 samples. With `--step-batch-size-schedule "0:384 200B:768 400B:1152"` the global batch is the one of
the last entry whose threshold the consumed samples reached:

    current(consumed) = B_k   for the largest k with T_k <= consumed

thresholds given in tokens (suffixes K, M, B, T: 1e3 .. 1e12) and turned into samples as T // seq_length
(Megatron-LM passes the sequence length; without one they are samples). One calculator lives in this module
(Megatron's global); the training loop calls `update_num_microbatches(consumed_samples)` before every step.
"""

import logging
from abc import ABC, abstractmethod
from typing import List, Optional

import torch.distributed as dist

from . import parallel_state

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def _data_parallel_derivation(data_parallel_size: int) -> Optional[str]:
    """'data-parallel size 2 = world size 8 / (tensor 2 x pipeline 2 x context 1)', when it can be told."""
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    world_size = dist.get_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    if world_size // (tp * pp * cp) != data_parallel_size:
        return None
    return (
        f"data-parallel size {data_parallel_size} = world size {world_size} / (tensor {tp} x pipeline {pp} x "
        f"context {cp} parallel)"
    )


def _batch_size_error(
    batch_sizes: List[int],
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool,
    is_ramp: bool = False,
) -> ValueError:
    """A message that shows the arithmetic, the nearest valid sizes and the other ways out."""
    unit = micro_batch_size * data_parallel_size
    first = batch_sizes[0]
    shown = ", ".join(str(size) for size in batch_sizes[:8]) + (", ..." if len(batch_sizes) > 8 else "")
    subject = f"ramp-up global batch sizes {shown} are" if is_ramp else f"global batch size {shown} is"
    problem = "smaller than" if decrease_batch_size_if_needed else "not divisible by"
    lines = [
        f"{subject} {problem} micro batch size ({micro_batch_size}) x data-parallel size ({data_parallel_size}) "
        f"= {unit}: every step trains global batch = micro batch size x number of microbatches x data-parallel size"
    ]
    derivation = _data_parallel_derivation(data_parallel_size)
    if derivation:
        lines.append(derivation)
    below = first // unit * unit
    nearest = [
        f"{size} ({size // unit} microbatch{'es' if size > unit else ''})" for size in (below, below + unit) if size > 0
    ]
    lines.append(f"nearest valid global batch sizes to {first}: {', '.join(nearest)}")
    if first % data_parallel_size == 0:
        per_replica = first // data_parallel_size
        divisors = [str(size) for size in range(1, per_replica + 1) if per_replica % size == 0]
        lines.append(
            f"micro batch sizes that fit {first} at data-parallel size {data_parallel_size}: {', '.join(divisors)}"
        )
    else:
        lines.append(
            f"no micro batch size fits {first}: it is not divisible by the data-parallel size {data_parallel_size}"
        )
    if is_ramp:
        lines.append(f"choose --rampup-batch-size START and INCR as multiples of {unit}")
    if not decrease_batch_size_if_needed and first >= unit:
        lines.append(f"or pass --decrease-batch-size-if-needed to round the global batch down to a multiple of {unit}")
    return ValueError("\n".join(lines))


def num_microbatches_for(
    global_batch_size: int, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool
) -> tuple:
    """(number of microbatches, running global batch size) for one global batch size; raises when the global
    batch is no whole number of microbatches (or, with `decrease_batch_size_if_needed`, smaller than one)."""
    unit = micro_batch_size * data_parallel_size
    running = global_batch_size // unit * unit if decrease_batch_size_if_needed else global_batch_size
    if running % unit or running == 0:
        raise _batch_size_error(
            [global_batch_size], micro_batch_size, data_parallel_size, decrease_batch_size_if_needed
        )
    return running // unit, running


def ramped_global_batch_size(
    consumed_samples: int, global_batch_size: int, start: int, increment: int, ramp_samples: int
) -> int:
    """The global batch size after `consumed_samples` of a ramp-up from `start` by `increment` over
    `ramp_samples` samples (the module docstring's formula); `global_batch_size` once the ramp is over."""
    num_increments = (global_batch_size - start) // increment
    samples_per_increment = ramp_samples / num_increments if num_increments else 0.0
    if consumed_samples > ramp_samples or samples_per_increment == 0.0:
        return global_batch_size
    # Divided by the float samples-per-increment, as Megatron does: the same rounding gives the same ramp.
    return start + int(consumed_samples / samples_per_increment) * increment


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _schedule_number(text: str, entry: str) -> int:
    """A threshold or batch size of the schedule: a number with an optional K/M/B/T suffix, as Megatron-LM reads
    it (`int(float(number) * multiplier)`)."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIXES else text
    try:
        return int(float(number) * multiplier)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: {text!r} is not a number (with an optional "
                         "K, M, B or T suffix)") from None


def parse_step_batch_size_schedule(schedule: str, seq_length: Optional[int] = None) -> List[tuple]:
    """[(threshold in samples, global batch size)] of a schedule "THRESHOLD:BATCH ..." (entries separated by
    spaces or commas), sorted by threshold; thresholds are tokens when `seq_length` is given (module
    docstring). Raises unless the first threshold is 0, the thresholds (in samples) strictly increase and every
    batch size is positive. Divisibility by micro batch x data-parallel size is checked when an entry is reached:
    early entries may predate this run's layout (a resumed run on more GPUs), as in Megatron-LM."""
    entries = schedule.replace(",", " ").split()
    if not entries:
        raise ValueError("--step-batch-size-schedule is empty; expected entries THRESHOLD:BATCH_SIZE, e.g. "
                         '"0:384 200B:768"')
    parsed = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch_size = (_schedule_number(part, entry) for part in entry.split(":", 1))
        parsed.append((threshold // seq_length if seq_length else threshold, batch_size))
    parsed.sort(key=lambda item: item[0])
    unit = f"samples (tokens // sequence length {seq_length})" if seq_length else "samples"
    thresholds = [threshold for threshold, _ in parsed]
    problems = []
    if thresholds[0] != 0:
        problems.append(f"the first threshold must be 0, got {thresholds[0]} {unit}")
    repeated = sorted({value for value, following in zip(thresholds, thresholds[1:]) if value == following})
    if repeated:
        problems.append(f"thresholds must strictly increase, {repeated} {unit} repeat")
    problems += [f"batch size {batch_size} must be positive" for _, batch_size in parsed if batch_size <= 0]
    if problems:
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: " + "; ".join(problems))
    return parsed


def step_global_batch_size(consumed_samples: int, schedule: List[tuple]) -> int:
    """The global batch of a parsed schedule once `consumed_samples` were consumed (module docstring)."""
    return [batch_size for threshold, batch_size in schedule if threshold <= consumed_samples][-1]


class NumMicroBatchesCalculator(ABC):
    """Current global batch size and microbatch count; `update` moves them with consumed samples."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool):
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro batch size ({micro_batch_size}) and data-parallel size ({data_parallel_size}) must be positive"
            )
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.num_micro_batches = None
        self.current_global_batch_size = None
        self.current_running_global_batch_size = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """The batch actually trained: the global batch rounded down under --decrease-batch-size-if-needed."""
        return self.current_running_global_batch_size

    def _set_global_batch_size(self, global_batch_size: int) -> None:
        self.current_global_batch_size = global_batch_size
        self.num_micro_batches, self.current_running_global_batch_size = num_microbatches_for(
            global_batch_size, self.micro_batch_size, self.data_parallel_size, self.decrease_batch_size_if_needed
        )

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """Moves to the batch size for `consumed_samples`.

        Every batch size the schedule can reach is checked when the calculator is built, so
        `consistency_check` (kept for Megatron-LM's signature) has nothing left to check.
        """


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A fixed global batch size."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
    ) -> None:
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed)
        self._set_global_batch_size(global_batch_size)
        if rank == 0 and self.current_running_global_batch_size != global_batch_size:
            logger.info(
                "decreasing batch size from %d to %d to keep divisibility by micro_batch_size=%d * "
                "data_parallel_size=%d", global_batch_size, self.current_running_global_batch_size,
                micro_batch_size, data_parallel_size,
            )

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """A constant global batch size does not move."""


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch size growing from `start_global_batch_size` by `batch_size_increment` over `ramup_samples`."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool,
        rank: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
    ) -> None:
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed)
        problems = []
        if start_global_batch_size <= 0 or batch_size_increment <= 0 or ramup_samples < 0:
            problems.append(
                f"--rampup-batch-size START INCR SAMPLES needs START > 0, INCR > 0, SAMPLES >= 0; got "
                f"{start_global_batch_size} {batch_size_increment} {ramup_samples}"
            )
        elif global_batch_size < start_global_batch_size:
            problems.append(
                f"the ramp-up start batch size ({start_global_batch_size}) exceeds the global batch size "
                f"({global_batch_size})"
            )
        elif (global_batch_size - start_global_batch_size) % batch_size_increment:
            problems.append(
                f"global batch size {global_batch_size} - start batch size {start_global_batch_size} = "
                f"{global_batch_size - start_global_batch_size} is not divisible by the batch size increment "
                f"{batch_size_increment}"
            )
        if problems:
            raise ValueError("invalid batch size ramp-up: " + "; ".join(problems))
        self.global_batch_size = global_batch_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.rank = rank

        ramp = list(range(start_global_batch_size, global_batch_size + 1, batch_size_increment))
        unit = micro_batch_size * data_parallel_size
        bad = [size for size in ramp if (size < unit if decrease_batch_size_if_needed else size % unit)]
        if bad:
            raise _batch_size_error(
                bad, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, is_ramp=True
            )
        self.update(0, consistency_check=False, verbose=True)

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        global_batch_size = ramped_global_batch_size(
            consumed_samples, self.global_batch_size, self.start_global_batch_size, self.batch_size_increment,
            self.ramup_samples,
        )
        previous = self.current_global_batch_size
        self._set_global_batch_size(global_batch_size)
        if verbose and self.rank == 0 and previous != global_batch_size:
            if previous is None:
                logger.info("setting initial batch size to %d", global_batch_size)
            else:
                logger.info("ramping up batch size from %d to %d", previous, global_batch_size)


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """The global batch of a step schedule (`parse_step_batch_size_schedule`) at the consumed samples."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool,
                 rank: int, schedule: str, seq_length: Optional[int] = None) -> None:
        if decrease_batch_size_if_needed:
            raise ValueError("--step-batch-size-schedule cannot go with --decrease-batch-size-if-needed")
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed)
        self.schedule = parse_step_batch_size_schedule(schedule, seq_length)
        self.global_batch_size = self.schedule[-1][1]
        self.rank = rank
        if rank == 0:
            logger.info("step batch size schedule %r: %s", schedule, ", ".join(
                f">= {threshold} samples -> global batch {batch_size}" for threshold, batch_size in self.schedule))
        self.update(0, consistency_check=False, verbose=True)

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """The schedule's batch; with `consistency_check` it must be a whole number of microbatches (without,
        the count is rounded down, as Megatron-LM's walk over a schedule made for another layout)."""
        global_batch_size = step_global_batch_size(consumed_samples, self.schedule)
        unit = self.micro_batch_size * self.data_parallel_size
        if consistency_check and global_batch_size % unit:
            raise _batch_size_error([global_batch_size], self.micro_batch_size, self.data_parallel_size, False)
        previous = self.current_global_batch_size
        self.current_global_batch_size = self.current_running_global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // unit
        if verbose and self.rank == 0 and previous != global_batch_size:
            logger.info("setting global batch size to %d at %d consumed samples", global_batch_size, consumed_samples)


def _build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
) -> NumMicroBatchesCalculator:
    if step_batch_size_schedule is not None:
        if rampup_batch_size is not None:
            raise ValueError("give --step-batch-size-schedule or --rampup-batch-size, not both")
        return StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank, step_batch_size_schedule,
            seq_length,
        )
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank
        )
        if rank == 0:
            logger.info("setting number of microbatches to constant %d", calculator.get())
        return calculator
    if len(rampup_batch_size) != 3:
        raise ValueError(
            "--rampup-batch-size takes three numbers: <start batch size> <batch size increment> <ramp-up samples>, "
            f"got {list(rampup_batch_size)}"
        )
    start, increment, samples = (int(value) for value in rampup_batch_size)
    if rank == 0:
        logger.info(
            "will use batch size rampup starting from global batch size %d to global batch size %d with batch "
            "size increments %d over %d samples.", start, global_batch_size, increment, samples,
        )
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank,
        start, increment, samples,
    )


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError(
            "the num-microbatches calculator is not initialised: call init_num_microbatches_calculator first"
        )
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
) -> None:
    """Builds the global calculator (constant, ramp-up from `[start, increment, samples]`, or the step schedule,
    whose thresholds are tokens when `seq_length` is given); rank 0 logs."""
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError(
            "the num-microbatches calculator is already initialised: use reconfigure_num_microbatches_calculator "
            "or destroy_num_microbatches_calculator first"
        )
    reconfigure_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
        step_batch_size_schedule, seq_length,
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
) -> None:
    """Replaces the global calculator (e.g. evaluation with another batch size)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
        step_batch_size_schedule, seq_length,
    )


def destroy_num_microbatches_calculator() -> None:
    """Forgets the global calculator."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator


def get_num_microbatches() -> int:
    """Microbatches per global batch at the current point of the ramp-up."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """The global batch size at the current point of the ramp-up."""
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """The global batch actually trained (rounded down under --decrease-batch-size-if-needed)."""
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    """Moves the global calculator to the batch size for `consumed_samples`."""
    _calculator().update(consumed_samples, consistency_check, verbose)
