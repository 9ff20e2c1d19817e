"""The re-run engine on a toy training step: a loss made of the microbatch's data and a random draw, so that
a re-run must see the same data and the same random state to reproduce it.

Each case runs iterations of `_step` and records what the engine decided; the first iteration of a job is
never validated (Megatron-LM's rule), so the cases look at the second.
"""

import logging
import math

import pytest
import torch

from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)


@pytest.fixture(autouse=True)
def _fresh_engine():
    destroy_rerun_state_machine()
    yield
    destroy_rerun_state_machine()


def _engine(mode="validate_results", rate=0, kind="transient_error"):
    initialize_rerun_state_machine(mode=RerunMode(mode),
                                   error_injector=RerunErrorInjector(rate, RerunDiagnostic(kind)))
    return get_rerun_state_machine()


def _step(engine, data, fatal=True, nan_runs=()):
    """One iteration of two microbatches; returns (the losses of every run, the engine's exit decision).
    `nan_runs`: the runs (0: initial, 1: re-run) whose first microbatch loss is NaN."""
    runs = []
    while engine.should_run_forward_backward(data):
        losses = []
        for microbatch in range(2):
            loss = next(data) + torch.rand(())
            if microbatch == 0 and len(runs) in nan_runs:
                loss = loss * float("nan")
            engine.validate_result(loss, torch.isnan, "NaN loss", fatal=fatal)
            losses.append(loss)
        runs.append(losses)
    return runs, engine.should_checkpoint_and_exit()


def _data():
    return RerunDataIterator(iter(torch.arange(100.0)))


def test_a_clean_run_is_not_rerun():
    engine, data = _engine(), _data()
    for iteration in range(3):
        runs, decision = _step(engine, data)
        assert len(runs) == 1 and decision == (False, False, 0)
    assert [float(loss.floor()) for loss in runs[0]] == [4.0, 5.0]  # the data moved on each iteration


@pytest.mark.parametrize("kind", ["transient_error", "persistent_error"])
def test_the_rerun_replays_the_data_and_the_random_state(kind, caplog):
    engine, data = _engine(rate=1, kind=kind), _data()
    _step(engine, data)
    with caplog.at_level(logging.WARNING, logger="megatron.core.rerun_state_machine"):
        runs, decision = _step(engine, data, fatal=False)  # injected into the first validation
    assert len(runs) == 2
    assert [loss.item() for loss in runs[1]] == [loss.item() for loss in runs[0]]
    assert math.floor(runs[0][0].item()) == 2
    # Not fatal: training goes on with the re-run's results, transient or not.
    assert decision == (False, False, 0)
    name = {"transient_error": "Transient error", "persistent_error": "Persistent error"}[kind]
    assert f"Injecting error type {name}" in caplog.text
    assert "Result validation enabled" in caplog.text
    assert "Continuing normal execution because failed validation was not fatal" in caplog.text
    runs, decision = _step(engine, data, fatal=False)  # the next iteration reads new data
    assert math.floor(runs[-1][0].item()) == 4


def test_a_fatal_transient_error_exits_with_17_and_no_checkpoint(caplog):
    engine, data = _engine(rate=1), _data()
    _step(engine, data)
    with caplog.at_level(logging.WARNING, logger="megatron.core.rerun_state_machine"):
        runs, decision = _step(engine, data)
    assert len(runs) == 2 and decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert "First rerun: unexpected result is not reproducible within the tolerance" in caplog.text
    assert "Possible transient error!!" in caplog.text


def test_a_fatal_persistent_error_asks_for_a_checkpoint_and_exits_with_16(caplog):
    engine, data = _engine(rate=1, kind="persistent_error"), _data()
    _step(engine, data)
    with caplog.at_level(logging.WARNING, logger="megatron.core.rerun_state_machine"):
        runs, decision = _step(engine, data)
    assert len(runs) == 2 and decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert "First rerun: unexpected result is reproducible within the tolerance" in caplog.text
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic") in caplog.text


@pytest.mark.parametrize("nan_runs, expected", [((0,), (False, True, 17)), ((0, 1), (True, True, 16))])
def test_a_real_nan_is_told_transient_or_reproducible(nan_runs, expected):
    engine, data = _engine(), _data()
    _step(engine, data)
    runs, decision = _step(engine, data, nan_runs=nan_runs)
    assert len(runs) == 2 and decision == expected


def test_the_first_iteration_is_not_validated():
    engine, data = _engine(), _data()
    runs, decision = _step(engine, data, nan_runs=(0,))
    assert len(runs) == 1 and decision == (False, False, 0)


def test_disabled_never_reruns_and_a_fatal_rejection_raises():
    engine, data = _engine(mode="disabled", rate=1), _data()
    for _ in range(2):
        runs, decision = _step(engine, data)
        assert len(runs) == 1 and decision == (False, False, 0)
    with pytest.raises(RuntimeError, match=r"iteration 3: Unexpected result .*message='NaN loss'"):
        _step(engine, data, nan_runs=(0,))


def test_spiky_values_are_measured_against_the_first_samples():
    engine = _engine()
    samples = [engine.is_unexpectedly_large(torch.tensor(value), 10, "loss", num_samples=3)
               for value in (1.0, 3.0, 2.0, 29.0, 30.0, float("nan"))]
    assert samples == [False, False, False, False, True, False]


def test_a_rank_that_rejected_nothing_reruns_without_an_old_verdict(monkeypatch):
    from megatron.core import rerun_state_machine

    engine, data = _engine(rate=1), _data()
    _step(engine, data)
    _step(engine, data, fatal=False)  # this rank's injected rejection, re-run, training went on
    engine.error_injector.error_injection_rate = 0
    # Another rank rejects a value of the next iteration: every rank re-runs it.
    monkeypatch.setattr(rerun_state_machine, "_reduce_any", lambda flags: [True] if len(flags) == 1 else flags)
    runs, decision = _step(engine, data, fatal=False)
    assert len(runs) == 2
    assert not engine.continue_requested and not engine.checkpoint_requested  # the decision is the other rank's


def test_a_checkpoint_for_megatrons_second_rerun_is_named_on_loading(capsys):
    from megatron.core.rerun_state_machine import RerunState
    from megatron.training.rerun_engine import note_pending_rerun

    note_pending_rerun({"rerun_state_machine": {"state": RerunState.NOT_RUNNING_YET}}, 7)
    note_pending_rerun({}, 7)
    assert capsys.readouterr().out == ""
    note_pending_rerun({"rerun_state_machine": {"state": RerunState.WILL_RERUN_FROM_CHECKPOINT}}, 7)
    assert "to re-run iteration 8 on another GPU" in capsys.readouterr().out
