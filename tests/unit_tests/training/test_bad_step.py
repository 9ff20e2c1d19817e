"""BadStepGuard: which rank saw a non-finite loss or gradient, loss spikes, and the stop / skip policies.

The gradients are poisoned on one rank only, before a hand-written data-parallel all-reduce (as DDP's
reduction would spread the NaN to every rank), so only the check before the reduction can name the rank.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.training.bad_step import EXIT_CODE_BAD_STEP, BadStepGuard, BadStepStop, stop_on_bad_step
from megatron.training.parallel_layout import ParallelLayout
from tests.unit_tests.dist_utils import run_distributed


def _args(**overrides):
    settings = dict(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False, bad_step_policy="stop",
                    bad_step_skip_budget=1, spiky_loss_factor=2.0, spiky_loss_window=3, overlap_grad_reduce=False,
                    cuda_graph_impl="none", rerun_mode=None)
    settings.update(overrides)
    return SimpleNamespace(**settings)


def _all_reduce_grads(model, *unused):
    """The data-parallel reduction (none in the single-process tests)."""
    if dist.is_initialized():
        for param in model[0].parameters():
            dist.all_reduce(param.grad)


def _step(guard, model, poison_grads: bool, loss_value: float = 1.0):
    """Backward through `model`, the finalize hook, the gradient norm, then the guard's verdict (or
    BadStepStop)."""
    model[0].zero_grad()
    output = model[0](torch.ones(2, 4)).sum()
    if poison_grads:
        output.register_hook(lambda grad: grad * float("nan"))
    output.backward()
    guard.wrap_finalize(_all_reduce_grads, model)(model)
    reports = [{"lm loss": torch.tensor([loss_value * 8, 8.0])}]
    grad_norm = torch.stack([param.grad.norm() for param in model[0].parameters()]).norm()
    return guard.check(reports, {"lm loss": torch.tensor(loss_value)}, grad_norm, scheduler_increment=8)


def _poisoned_gradients_on_rank_1(rank, world_size):
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(1)
    parallel_state.initialize_model_parallel()  # two data-parallel ranks
    layout = ParallelLayout.from_parallel_state()
    model = [torch.nn.Linear(4, 3)]
    results = {}

    skip = BadStepGuard(_args(bad_step_policy="skip"), start_iteration=10, layout=layout)
    results["clean"] = _step(skip, model, poison_grads=False)
    results["skipped"] = _step(skip, model, poison_grads=rank == 1)
    results["grads_after_reduction_finite"] = all(torch.isfinite(p.grad).all().item() for p in model[0].parameters())
    results["skipped_grad_norm"] = skip.skipped_grad_norm
    with pytest.raises(BadStepStop, match=r"iteration 13: non-finite gradients on rank\(s\) \[1\] before the "
                                          r"data-parallel reduction; stopping \(--bad-step-skip-budget 1 is used up\)"):
        _step(skip, model, poison_grads=rank == 1)

    stop = BadStepGuard(_args(), start_iteration=4, layout=layout)
    with pytest.raises(BadStepStop) as stopped:
        _step(stop, model, poison_grads=rank == 0, loss_value=float("inf"))
    results["stop_message"] = str(stopped.value)
    results["last_good_iteration"] = stopped.value.iteration
    get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()
    return results


def test_poisoned_gradients_of_one_rank_are_reported_with_that_rank_on_every_rank(capsys):
    for rank, results in enumerate(run_distributed(_poisoned_gradients_on_rank_1, 2)):
        assert results["clean"] is False and results["skipped"] is True, rank
        assert not results["grads_after_reduction_finite"]  # the reduction spread the NaN to both ranks
        assert math.isnan(results["skipped_grad_norm"])
        assert results["stop_message"] == ("bad step at iteration 5: non-finite loss on rank(s) [0, 1]; non-finite "
                                           "gradients on rank(s) [0] before the data-parallel reduction; stopping "
                                           "(--bad-step-policy stop)")
        assert results["last_good_iteration"] == 4


@pytest.fixture
def layout():
    """The layout of a one-process run: a gloo world of one rank and its parallel groups; seeded generators."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(1)
    yield ParallelLayout.from_parallel_state()
    get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_loss_spike_over_the_window_mean_is_a_bad_step(layout, capsys):
    guard = BadStepGuard(_args(check_for_nan_in_loss_and_grad=False, check_for_spiky_loss=True,
                               bad_step_policy="skip", bad_step_skip_budget=5), start_iteration=0, layout=layout)
    model = [torch.nn.Linear(4, 3)]
    # Until the window of 3 accepted losses is full nothing is a spike (50 passes); 3 < 2 x mean(1, 50, 2).
    assert [_step(guard, model, False, loss) for loss in (1.0, 50.0, 2.0, 3.0)] == [False, False, False, False]
    assert _step(guard, model, False, 70.0) is True  # 2 x mean(50, 2, 3) = 36.7 < 70
    assert "iteration 5: loss spike: lm loss 7.000000E+01 is more than 2 x the mean of the last 3" in \
        capsys.readouterr().out
    assert guard.skipped_grad_norm is None  # nothing was non-finite
    assert _step(guard, model, False, 30.0) is False


def test_stop_restores_the_generators_of_before_the_bad_step(layout, capsys):
    guard = BadStepGuard(_args(), start_iteration=7, layout=layout)
    before = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    model = [torch.nn.Linear(4, 3)]  # draws from the generators, as the bad step's dropout would
    with pytest.raises(BadStepStop) as stopped:
        _step(guard, model, poison_grads=False, loss_value=float("nan"))
    assert torch.equal(torch.get_rng_state(), before[0])
    assert all(torch.equal(state, before[1][name]) for name, state in get_cuda_rng_tracker().get_states().items())
    saved = []
    assert stop_on_bad_step(stopped.value, lambda: saved.append(True)) == EXIT_CODE_BAD_STEP and saved
    assert "ERROR: bad step at iteration 8: non-finite loss on rank(s) [0]" in capsys.readouterr().out


def test_nothing_is_checked_when_both_checks_are_off(layout):
    guard = BadStepGuard(_args(check_for_nan_in_loss_and_grad=False), start_iteration=0, layout=layout)
    assert _step(guard, [torch.nn.Linear(4, 3)], poison_grads=True, loss_value=float("nan")) is False


class _DeviceVetoOptimizer:
    """An optimizer that skips vetoed updates itself (as the fused AdamW does on a GPU)."""

    def __init__(self):
        self.rewinds = 0

    def supports_device_veto(self):
        return True

    def rewind_vetoed_update(self):
        self.rewinds += 1


class _Scheduler:
    def __init__(self):
        self.num_steps = 0

    def step(self, increment):
        self.num_steps += increment


def test_a_verdict_left_on_the_device_is_settled_at_the_next_check(layout, capsys):
    optimizer, scheduler = _DeviceVetoOptimizer(), _Scheduler()
    guard = BadStepGuard(_args(bad_step_policy="skip", bad_step_skip_budget=1), 20, layout, optimizer, scheduler)
    model = [torch.nn.Linear(4, 3)]
    assert guard.defers
    verdicts = []
    for poison in (False, True):
        verdicts.append(_step(guard, model, poison_grads=poison))
        scheduler.step(8)  # the loop steps the scheduler for every update not skipped at once
    assert [int(verdict) for verdict in verdicts] == [0, 1] and guard.device_veto is verdicts[-1]
    assert optimizer.rewinds == 0 and scheduler.num_steps == 16  # nothing is known on the host yet
    _step(guard, model, poison_grads=False)  # settles iteration 22: skipped, its scheduler step taken back
    assert optimizer.rewinds == 1 and scheduler.num_steps == 8
    assert "bad step at iteration 22: non-finite gradients on rank(s) [0] (the global gradient norm); skipping" in \
        capsys.readouterr().out
    scheduler.step(8)
    _step(guard, model, poison_grads=True)  # iteration 24, over the budget: found at the end of the run
    scheduler.step(8)
    with pytest.raises(BadStepStop, match="iteration 24: .*--bad-step-skip-budget 1 is used up") as stopped:
        guard.resolve()
    assert stopped.value.iteration == 23 and optimizer.rewinds == 2 and scheduler.num_steps == 16


def test_a_deferred_stop_restores_the_generators_of_before_the_bad_step(layout):
    guard = BadStepGuard(_args(), 3, layout, _DeviceVetoOptimizer(), _Scheduler())
    before = torch.get_rng_state()
    model = [torch.nn.Linear(4, 3)]  # draws from the generator, as the bad step's dropout would
    _step(guard, model, poison_grads=False, loss_value=float("nan"))  # iteration 4, bad, not known yet
    torch.rand(5)  # the next step's randomness
    with pytest.raises(BadStepStop, match="iteration 4: non-finite loss") as stopped:
        _step(guard, model, poison_grads=False)
    assert stopped.value.iteration == 3 and torch.equal(torch.get_rng_state(), before)
