"""The re-run engine: tells a transient hardware fault from a reproducible result when a validated value (a
loss, a gradient norm) is unexpected, by running the iteration again on the same data and random state.

One iteration under `--rerun-mode validate_results`:

    initial run          forward/backward; `validate_result(value, reject, message, fatal)` rejects a value
                         (NaN, Inf, a spike); the first rejected call of the iteration is remembered (its
                         message, rank and how many times that message was validated before it) with its value
    re-run in place      when any rank rejected a value: the random generators (Python, NumPy, torch, CUDA and
                         the caller's, e.g. the tensor-parallel tracker) are put back as they were, the data
                         iterator replays the iteration's microbatches, forward/backward run again; the same
                         call compares its new value with the first one (relative difference, `tolerance`)
        different        "Possible transient error": a non-fatal check continues training with the re-run's
                         gradients; a fatal one exits with EXIT_CODE_FAILED_ON_RESULT_VALIDATION (17), no
                         checkpoint (the update was never applied: resume from the last checkpoint)
        the same         reproducible: a non-fatal check continues; a fatal one asks for a checkpoint of the
                         state before the update and exits with EXIT_CODE_RESUME_TO_DISAMBIGUATE (16), so that
                         the step can be re-run on another GPU

Every decision is all-reduced over the world so that all ranks take the same branch. No value is validated
in a job's first iteration (a checkpoint may not be possible before the first update).

Error injection (`RerunErrorInjector`, tests of the machinery): at rate r, each validation of an initial run
is rejected with probability 1/r (at most once an iteration, on the ranks where (randint(0, r-1) + rank) % r
is 0); the re-run's comparison then reports a mismatch for a transient error and a match for a persistent
one, whatever the values.

Megatron-LM's second re-run, from the checkpoint on another GPU (persistent vs correct result), and its
determinism statistics mode are not built here: a job resumed from the checkpoint of a reproducible result
re-runs that iteration as a new one.
"""

import logging
import math
import os
import random
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.datasets.rank_logging import global_rank

logger = logging.getLogger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

COMPARISON_MATCH = 0.0
COMPARISON_MISMATCH = math.inf


class RerunMode(str, Enum):
    """What the engine does: nothing but a plain check (disabled), or re-run iterations with rejected values."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"


class RerunDiagnostic(str, Enum):
    """The attribution of an unexpected value (and the kinds of error the injector simulates)."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunState(Enum):
    """Where the engine is in the current iteration (module docstring)."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3


class Caller(NamedTuple):
    """A validation site: its message and the rank calling it."""

    message: str
    rank: int


class Call(NamedTuple):
    """The `sequence`-th validation of `caller` in the iteration (the same in a re-run: control flow is
    deterministic given the data and the random state)."""

    caller: Caller
    sequence: int


def _device_name() -> str:
    return str(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def _reduce_any(values: list) -> list:
    """Each flag OR-ed over the world (one all-reduce; the identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [bool(value) for value in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor([int(value) for value in values], dtype=torch.int32, device=device)
    dist.all_reduce(flags)
    return [value > 0 for value in flags.tolist()]


def compare_floats(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference |a - b| / mean(|a|, |b|)-like of two scalars: 0 when equal (two NaNs are equal),
    inf when one is NaN or infinite and the other not."""
    x, y = float(a), float(b)
    if x == y or (math.isnan(x) and math.isnan(y)):
        return COMPARISON_MATCH
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return COMPARISON_MISMATCH
    return math.fabs((x - y) / (x + y) * 2)


class RerunErrorInjector:
    """Simulated faults (module docstring): `error_injection_rate` 0 injects nothing."""

    _NAMES = {RerunDiagnostic.CORRECT_RESULT: "Expected result", RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
              RerunDiagnostic.PERSISTENT_ERROR: "Persistent error"}

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR):
        if error_injection_rate < 0:
            raise ValueError(f"error_injection_rate {error_injection_rate} must be >= 0")
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = RerunDiagnostic(error_injection_type)
        self.injected_error_type: Optional[RerunDiagnostic] = None  # set while an injected error is in flight

    def maybe_inject(self) -> bool:
        """True when this validation is to be rejected (at most one injection in flight)."""
        rate = self.error_injection_rate
        if rate == 0 or self.injected_error_type is not None:
            return False
        if (random.randint(0, rate - 1) + global_rank()) % rate != 0:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning(f"Injecting error type {self._NAMES[self.error_injection_type]}")
        return True

    def maybe_miscompare(self, comparison_func: Callable, initial_result, result) -> float:
        """The re-run's comparison: the real one, or the injected error's verdict (which ends the injection)."""
        injected, self.injected_error_type = self.injected_error_type, None
        if injected is None:
            return comparison_func(initial_result, result)
        return COMPARISON_MISMATCH if injected == RerunDiagnostic.TRANSIENT_ERROR else COMPARISON_MATCH


class RerunDataIterator:
    """A data iterator that keeps the microbatches of the current iteration to replay them in a re-run."""

    def __init__(self, iterable):
        self.iterable = iterable
        self.saved_microbatches: list = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("the re-run of the iteration reads more microbatches than the initial run did")
            item = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return item
        item = next(self.iterable)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            # A shallow copy: code that replaces entries of the batch dict leaves the replayed one intact.
            self.saved_microbatches.append(item.copy() if isinstance(item, dict) else item)
        return item

    def rewind(self) -> None:
        """Replay from the iteration's first microbatch."""
        self.replaying, self.replay_pos = True, 0

    def advance(self) -> None:
        """A new iteration: forget the kept microbatches and read the underlying iterator again."""
        self.replaying, self.saved_microbatches = False, []


def _iterators(data_iterator) -> list:
    """The RerunDataIterators of `data_iterator` (one, a list of them per model chunk, or None)."""
    items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    items = [item for item in items if item is not None]
    for item in items:
        if not isinstance(item, RerunDataIterator):
            raise TypeError("--rerun-mode validate_results re-runs an iteration on the same data: the data "
                            f"iterator must be wrapped in RerunDataIterator (got {type(item).__name__})")
    return items


class RerunStateMachine:
    """The engine (module docstring); one per process, from `initialize_rerun_state_machine`.

    `state_save_func()` / `state_restore_func(saved)`: any random state beyond Python's, NumPy's, torch's and
    CUDA's generators that a re-run must start from again (the tensor-parallel RNG tracker).

    The training step drives it:

        while machine.should_run_forward_backward(data_iterator):
            zero the gradients; forward and backward over the iteration's microbatches
            (the loss function calls machine.validate_result(...))
        should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
        if should_exit: save a checkpoint if asked (the update is not applied) and exit with exit_code
        optimizer step
    """

    def __init__(self, state_save_func: Optional[Callable[[], Any]] = None,
                 state_restore_func: Optional[Callable[[Any], None]] = None,
                 mode: RerunMode = RerunMode.DISABLED, error_injector: Optional[RerunErrorInjector] = None):
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1  # 0-based; messages show it 1-based
        self.first_iteration_complete = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.state_save_func, self.state_restore_func = state_save_func, state_restore_func
        self.saved_state = None
        self.validation_counts: dict = {}
        self.failed_validation_call: Optional[Call] = None
        self.initial_result = None
        # This rank's requests, OR-ed over the world at the end of each run of the iteration.
        self.rerun_requested = self.checkpoint_requested = self.continue_requested = False
        self.logged_validation_enabled = False
        self.large_value_counts: dict = {}
        self.max_values: dict = {}
        logger.warning(f"RerunStateMachine initialized in mode {self.mode.value}")

    def set_mode(self, mode: RerunMode) -> None:
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        return self.mode

    def should_run_forward_backward(self, data_iterator) -> bool:
        """True when the forward-backward pass of the iteration is to be run (again); see the class docstring."""
        self.validation_counts = {}
        iterators = _iterators(data_iterator) if self.mode != RerunMode.DISABLED else []
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            if self.mode != RerunMode.DISABLED:
                self._save_state()
                for iterator in iterators:
                    iterator.advance()
                self.rerun_requested = self.checkpoint_requested = self.continue_requested = False
                # A rank that rejected nothing re-runs with the others: it must not compare against an old
                # iteration's rejected value.
                self.failed_validation_call = self.initial_result = None
            return True
        if self.state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED or not _reduce_any([self.rerun_requested])[0]:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if global_rank() == 0:
                logger.warning("Need to rerun step to check reproducibility of initial result")
            self.state = RerunState.RERUNNING_IN_PLACE
            self._rewind(iterators)
            return True
        if self.state == RerunState.RERUNNING_IN_PLACE:
            will_continue, will_checkpoint = _reduce_any([self.continue_requested, self.checkpoint_requested])
            if will_continue:
                if global_rank() == 0:
                    logger.warning("Continuing normal execution because failed validation was not fatal")
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if will_checkpoint:
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            # The checkpoint (or the exit) is of the state before the iteration.
            self._rewind(iterators)
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {self.state.name}: the previous "
                           "iteration ended without should_checkpoint_and_exit()")

    def should_checkpoint_and_exit(self) -> tuple:
        """(save a checkpoint, exit, exit code) once the iteration's forward-backward runs are over."""
        self.first_iteration_complete = True
        if self.mode == RerunMode.DISABLED or self.state == RerunState.NOT_RUNNING_YET:
            self.state = RerunState.NOT_RUNNING_YET
            return False, False, 0
        state, self.state = self.state, RerunState.NOT_RUNNING_YET
        if state == RerunState.RERUNNING_IN_PLACE:
            if global_rank() == 0:
                logger.warning("Exiting now. The job can be resumed from a previous checkpoint")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if global_rank() == 0:
            logger.warning("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to "
                           "rerun the last iteration and establish a diagnostic")
        return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE

    def validate_result(self, result, rejection_func: Callable[[Any], Any], message: str,
                        comparison_func: Optional[Callable[[Any, Any], float]] = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Checks `result` (module docstring). `rejection_func(result)` is true for an unexpected value
        (torch.isnan, ...); `comparison_func(first, again)` is the relative difference of the values of the
        initial run and the re-run (default: `compare_floats`), reproducible when <= `tolerance`; `fatal`: stop
        the job on an unexpected value, else continue once it is attributed.

        Disabled: a rejected value raises RuntimeError when fatal and is logged otherwise."""
        where = f"Rank {global_rank()}, node {os.uname()[1]}, device {_device_name()}"
        if self.mode == RerunMode.DISABLED:
            if bool(rejection_func(result)):
                text = (f"{where}, iteration {self.current_iteration + 1}: Unexpected result {result} "
                        f"(message='{message}')")
                if fatal:
                    raise RuntimeError(text)
                logger.warning(text)
            return
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result is called outside the forward-backward pass of a training "
                               "iteration (should_run_forward_backward)")
        caller = Caller(message, global_rank())
        self.validation_counts[caller] = self.validation_counts.get(caller, 0) + 1
        call = Call(caller, self.validation_counts[caller])
        if not self.logged_validation_enabled:
            self.logged_validation_enabled = True
            if global_rank() == 0:
                logger.warning("Result validation enabled")

        def log_failure(text: str) -> None:
            (logger.error if fatal else logger.warning)(
                f"{where}, iteration #{self.current_iteration + 1}: {text}!")

        if self.state == RerunState.INITIAL_RUN:
            if self.rerun_requested or not self.first_iteration_complete:
                return
            if self.error_injector.maybe_inject() or bool(rejection_func(result)):
                self.failed_validation_call, self.initial_result = call, result
                self.rerun_requested = True
                logger.error(f"Unexpected result {result} on rank {global_rank()} at iteration "
                             f"#{self.current_iteration + 1} invocation #{call.sequence} (message='{message}')")
        elif self.state == RerunState.RERUNNING_IN_PLACE and call == self.failed_validation_call:
            comparison = self.error_injector.maybe_miscompare(comparison_func or compare_floats,
                                                              self.initial_result, result)
            if comparison > tolerance:
                self.continue_requested = not fatal
                log_failure("First rerun: unexpected result is not reproducible within the tolerance "
                            f"({result} != {self.initial_result})")
                log_failure("Possible transient error!")
            else:
                self.checkpoint_requested, self.continue_requested = fatal, not fatal
                log_failure(f"First rerun: unexpected result is reproducible within the tolerance ({result} = "
                            f"{self.initial_result}). Need to rerun on a different GPU to verify correctness")

    def is_unexpectedly_large(self, result: torch.Tensor, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """A rejection function: |result| >= `threshold` x the largest |value| of the first `num_samples`
        values seen under `context` (False while they are being collected, and for NaN/Inf, checked apart).
        `resample` starts collecting again."""
        value = math.fabs(float(result))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context], self.max_values[context] = 0, 0.0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values[context], value)
            if self.large_value_counts[context] == num_samples:
                logger.warning(f"Max value for {context}: {self.max_values[context]}")
            return False
        return value >= self.max_values[context] * threshold

    def _save_state(self) -> None:
        self.saved_state = {
            "random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "other": self.state_save_func() if self.state_save_func else None,
        }

    def _rewind(self, iterators: list) -> None:
        """The random state as before the iteration, the data iterators at its first microbatch."""
        saved = self.saved_state
        random.setstate(saved["random"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state(saved["cuda"])
        if saved["other"] is not None and self.state_restore_func:
            self.state_restore_func(saved["other"])
        for iterator in iterators:
            iterator.rewind()


_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> None:
    """Makes the process's engine (RerunStateMachine's arguments); replaces any previous one."""
    global _MACHINE
    _MACHINE = RerunStateMachine(**kwargs)


def destroy_rerun_state_machine() -> None:
    global _MACHINE
    _MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's engine; a disabled one when none was initialized."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = RerunStateMachine()
    return _MACHINE
