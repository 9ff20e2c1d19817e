"""The training loop's side of the re-run engine (megatron/core/rerun_state_machine.py): the engine made from
the arguments, and the training data iterators wrapped so that an iteration can be replayed.

    --rerun-mode validate_results   the engine validates the losses (NaN, Inf: fatal; with
                                    --check-for-spiky-loss, 10 x the largest of the first 100 losses of a
                                    rank: not fatal) and re-runs an iteration with a rejected loss; the
                                    bad-step guard (bad_step.py) keeps the gradient checks
    --rerun-mode disabled / unset   no re-runs: the bad-step guard checks losses and gradients
"""

from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.training.console import print_rank_0


def validates_results(args) -> bool:
    """True when the engine validates results (and re-runs iterations) in this run."""
    return args.rerun_mode == RerunMode.VALIDATE_RESULTS.value


def start_rerun_engine(args, iteration: int) -> None:
    """The process's engine for a training loop that starts after `iteration` iterations."""
    initialize_rerun_state_machine(
        state_save_func=lambda: get_cuda_rng_tracker().get_states(),
        state_restore_func=lambda states: get_cuda_rng_tracker().set_states(states),
        mode=RerunMode.VALIDATE_RESULTS if validates_results(args) else RerunMode.DISABLED,
        error_injector=RerunErrorInjector(args.error_injection_rate, RerunDiagnostic(args.error_injection_type)),
    )
    get_rerun_state_machine().current_iteration = iteration - 1  # the engine counts from its first step


def replayable(data_iterator):
    """`data_iterator` (one, a list per model chunk, or None) wrapped in RerunDataIterator."""
    if isinstance(data_iterator, list):
        return [replayable(item) for item in data_iterator]
    if data_iterator is None or isinstance(data_iterator, RerunDataIterator):
        return data_iterator
    return RerunDataIterator(data_iterator)


def note_pending_rerun(state_dict: dict, iteration: int) -> None:
    """One line when a checkpoint was saved by Megatron-LM's re-run engine for its second re-run (of the
    iteration after `iteration`, on another GPU), which is not built here: the run trains that iteration as
    a new one."""
    saved = state_dict.get("rerun_state_machine")
    if isinstance(saved, dict) and saved.get("state") == RerunState.WILL_RERUN_FROM_CHECKPOINT:
        print_rank_0(f"note: this checkpoint was saved by Megatron-LM's re-run engine to re-run iteration "
                     f"{iteration + 1} on another GPU and establish a diagnostic; that second re-run is not "
                     "supported yet: the iteration is trained as a new one")
