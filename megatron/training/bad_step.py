"""Bad training steps: non-finite loss or gradients on any rank, and loss spikes; what the run does about them.

Every iteration, between the backward pass and the optimizer's update, each rank checks what only it can see:

    loss      its own microbatch loss sums, before any reduction          (--check-for-nan-in-loss-and-grad;
              under --rerun-mode validate_results the re-run engine checks the losses and spikes instead)
    grads     its own gradients: before the data-parallel reduction (a norm per gradient buffer, recorded by
              the finalize hook below) when there is one to come, else the optimizer's global gradient norm
              (one process, --overlap-grad-reduce, a CUDA-graph iteration: no extra pass over the gradients)
    spike     the global loss against the mean of the last --spiky-loss-window accepted steps
              (last pipeline stage only)                                  (--check-for-spiky-loss)

One all-gather of three flags per rank gives every rank the same picture, so all take the same branch:

    --bad-step-policy stop   print which rank saw what at which iteration, save a checkpoint of the last good
                             state (the bad update is never applied) and exit with code 17
    --bad-step-policy skip   leave weights, optimizer and scheduler untouched, count the iteration as skipped
                             (and as nan when something was non-finite); stop as above once more than
                             --bad-step-skip-budget iterations were skipped in this run

Reading the flags on the host would make it wait for every step's backward pass before queueing the update
and the next step. Where the optimizer can skip an update on its own (the fused AdamW on a GPU) and no spike
check needs the loss on the host, the flags stay on the device: the update is skipped there when any rank
flagged the step, and the host reads the flags of a step at the next step's check (by then long computed,
copied to pinned memory as they were made) or before anything that needs them settled (a log line's counts
come from device counters; a save, an evaluation, the end of the run call `resolve()`). The scheduler and the
optimizer's step count advanced for a step later found bad are then taken back, so the run goes on exactly
as if the step had been skipped at once; a stop names the bad step and saves the state before it.
"""

import math

import torch
import torch.distributed as dist

from megatron.training.checkpointing.rng import get_rng_state, set_rng_state
from megatron.training.console import print_rank_0
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.rerun_engine import validates_results

# Megatron's rerun state machine exits with 17 when a result fails validation.
EXIT_CODE_BAD_STEP = 17

_LOSS, _GRADS, _SPIKE = range(3)


class BadStepStop(Exception):
    """Raised on every rank when the run must stop on a bad step; `iteration` is the last good one."""

    def __init__(self, message: str, iteration: int):
        super().__init__(message)
        self.iteration = iteration


def _ranks(flags: torch.Tensor, column: int) -> list:
    return [rank for rank, value in enumerate(flags[:, column].tolist()) if value]


def _nonfinite(tensors) -> torch.Tensor:
    """One int32 flag (no host sync): 1 if any entry of any tensor is inf or NaN. A norm is non-finite exactly
    when an entry is, and reads each tensor once (isfinite would write a mask of its size)."""
    norms = [tensor.detach().float().norm() for tensor in tensors]
    return (~torch.isfinite(torch.stack(norms).sum())).int() if norms else torch.zeros((), dtype=torch.int32)


class _Pending:
    """A step whose verdict is still on the device: its flags (being copied into pinned memory, `ready` once
    there), and what settling it may need (the generators before it, the scheduler samples to take back)."""

    def __init__(self, iteration: int, flags: torch.Tensor, ready, rng_before, scheduler_increment: int):
        self.iteration, self.flags, self.ready = iteration, flags, ready
        self.rng_before, self.scheduler_increment = rng_before, scheduler_increment


class BadStepGuard:
    """Applies the checks and the policy of the module docstring; one per training run.

    `layout` is this rank's place in the run (the flags are gathered from every rank; gradients are checked
    before a data-parallel reduction when there is one). `optimizer` and `scheduler` (optional) are what a
    deferred verdict must take back: the optimizer's host step count (`rewind_vetoed_update`) and the
    scheduler's samples (`step(-increment)`)."""

    def __init__(self, args, start_iteration: int, layout: ParallelLayout, optimizer=None, scheduler=None):
        self.check_nonfinite = bool(args.check_for_nan_in_loss_and_grad)
        # Under --rerun-mode validate_results the re-run engine validates the losses (rerun_engine.py).
        self.check_loss = self.check_nonfinite and not validates_results(args)
        self.check_spikes = bool(args.check_for_spiky_loss) and not validates_results(args)
        self.policy = args.bad_step_policy
        self.skip_budget = args.bad_step_skip_budget
        self.spike_factor = args.spiky_loss_factor
        self.spike_window = args.spiky_loss_window
        # With --overlap-grad-reduce the reduction starts inside backward, and a full-iteration CUDA graph
        # replays backward and reduction without running this Python: both use the global norm.
        self.grads_before_reduction = not (args.overlap_grad_reduce or args.cuda_graph_impl == "full_iteration")
        # Gradients are reduced over DP x CP: with more than one such rank, a rank's own gradients are checked
        # before the reduction mixes them.
        self.local_grads_checked = (self.check_nonfinite and self.grads_before_reduction
                                    and layout.data_context_parallel_size > 1)
        self.layout = layout
        self.optimizer, self.scheduler = optimizer, scheduler
        self.iteration = start_iteration
        self.skipped = 0
        self.recent_losses = []
        self._local_grads_nonfinite = None
        self._pending = None
        self.device_veto = None  # the last step's verdict when it was left on the device
        self.skipped_grad_norm = None  # reported for a skipped step: NaN when something was non-finite
        # The generators as they were before the step being inspected: a stop saves them, so that the
        # resumed run redoes that step with the same dropout masks.
        self._rng_before_step = get_rng_state(data_parallel_random_init=False) if self.enabled else None

    @property
    def enabled(self) -> bool:
        return self.check_nonfinite or self.check_spikes

    @property
    def defers(self) -> bool:
        """True when verdicts stay on the device (module docstring)."""
        return (self.check_nonfinite and not self.check_spikes and self.optimizer is not None
                and self.optimizer.supports_device_veto())

    def wrap_finalize(self, finalize_model_grads_func, model: list):
        """`finalize_model_grads_func` that first records whether this rank's own gradients are finite."""
        if not self.local_grads_checked:
            return finalize_model_grads_func

        def finalize_after_local_check(*args, **kwargs):
            for chunk in model:
                if hasattr(chunk, "zero_unwritten_grads"):  # DDP's buffers are emptied, not zeroed
                    chunk.zero_unwritten_grads()
            self._local_grads_nonfinite = _nonfinite(self._gradients(model))
            return finalize_model_grads_func(*args, **kwargs)

        return finalize_after_local_check

    @staticmethod
    def _gradients(model: list) -> list:
        """DDP's contiguous gradient buffers of each chunk (one norm each), or every parameter's gradient."""
        grads = []
        for chunk in model:
            if hasattr(chunk, "main_grad_buffers"):
                grads.extend(chunk.main_grad_buffers())
                continue
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                grads.append(grad if grad is not None else param.grad)
        return [grad for grad in grads if grad is not None]

    def check(self, loss_reports: list, loss_dict: dict, grad_norm, scheduler_increment: int = 0):
        """The verdict on the step just computed (collective), given the optimizer's gradient norm (a float
        or a device tensor). True: skip its update; False: update. When `defers`, a 1-element int32 device
        tensor instead (nonzero: the optimizer skips the update on the device) and the verdict is settled
        at the next `check` or `resolve()`, which may raise BadStepStop. `scheduler_increment`: the samples
        the scheduler will advance by if the update is not skipped at once (taken back for a deferred skip).
        Raises BadStepStop when the run must stop."""
        self.resolve()
        self.iteration += 1
        self.device_veto = None
        if not self.enabled:
            return False
        flags = self._local_flags(loss_reports, loss_dict, grad_norm)
        gathered = self._gather(flags)  # [world_size, 3]
        if self.defers:
            veto = gathered.amax().reshape(1)
            copied = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=gathered.is_cuda)
            copied.copy_(gathered, non_blocking=True)
            ready = torch.cuda.Event() if gathered.is_cuda else None
            if ready is not None:
                ready.record()
            self._pending = _Pending(self.iteration, copied, ready, self._rng_before_step, scheduler_increment)
            self._rng_before_step = get_rng_state(data_parallel_random_init=False)
            self.device_veto = veto
            return veto
        return self._settle(self.iteration, gathered.cpu(), loss_dict, self._rng_before_step, deferred=False)

    def resolve(self) -> None:
        """Settles the deferred verdict of the last step, if any (waits for its flags only). Raises
        BadStepStop when the run must stop."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None:
            pending.ready.synchronize()
        if not pending.flags.any():
            return
        if self.scheduler is not None and pending.scheduler_increment:
            self.scheduler.step(increment=-pending.scheduler_increment)
        self.optimizer.rewind_vetoed_update()
        self._settle(pending.iteration, pending.flags, {}, pending.rng_before, deferred=True)

    def _local_flags(self, loss_reports: list, loss_dict: dict, grad_norm) -> torch.Tensor:
        device = self.layout.device
        local = torch.zeros(3, dtype=torch.int32, device=device)
        if self.check_loss:
            local_losses = [torch.as_tensor(value).detach().float().view(-1)[:1]
                            for report in loss_reports for value in report.values()]
            local[_LOSS] = _nonfinite(local_losses).to(device)
        if self.check_nonfinite:
            if self._local_grads_nonfinite is not None:
                local[_GRADS] = self._local_grads_nonfinite.to(device)
            elif grad_norm is not None:
                local[_GRADS] = (~torch.isfinite(torch.as_tensor(grad_norm, dtype=torch.float32))).int().to(device)
            self._local_grads_nonfinite = None
        if self.check_spikes:
            self._spike_message = self._spike(loss_dict)
            local[_SPIKE] = int(self._spike_message is not None)
        return local

    def _settle(self, iteration: int, flags: torch.Tensor, loss_dict: dict, rng_before, deferred: bool) -> bool:
        """Applies the policy to a step's gathered flags (on the host); True when its update is skipped."""
        if not flags.any():
            self._remember(loss_dict)
            self._rng_before_step = get_rng_state(data_parallel_random_init=False)
            return False
        self.skipped_grad_norm = float("nan") if flags[:, [_LOSS, _GRADS]].any() else None
        spike_message = getattr(self, "_spike_message", None) if not deferred else None
        description = self._describe(iteration, flags, spike_message)
        if self.policy == "skip" and self.skipped < self.skip_budget:
            self.skipped += 1
            print_rank_0(f"WARNING: bad step at {description}; skipping this update "
                         f"({self.skipped} of --bad-step-skip-budget {self.skip_budget} used)")
            if not deferred:
                self._rng_before_step = get_rng_state(data_parallel_random_init=False)
            return True
        reason = ("--bad-step-policy stop" if self.policy == "stop"
                  else f"--bad-step-skip-budget {self.skip_budget} is used up")
        set_rng_state({"rng_state": rng_before}, False, "the state before the bad step")
        raise BadStepStop(f"bad step at {description}; stopping ({reason})", iteration - 1)

    def _spike(self, loss_dict: dict):
        if not loss_dict or len(self.recent_losses) < self.spike_window:
            return None
        key, value = next(iter(loss_dict.items()))
        value = float(value)
        mean = sum(self.recent_losses) / len(self.recent_losses)
        if math.isfinite(value) and value <= self.spike_factor * mean:
            return None
        return (f"{key} {value:.6E} is more than {self.spike_factor:g} x the mean of the last "
                f"{self.spike_window} iterations ({mean:.6E})")

    def _remember(self, loss_dict: dict) -> None:
        if self.check_spikes and loss_dict:
            self.recent_losses = (self.recent_losses + [float(next(iter(loss_dict.values())))])[-self.spike_window:]

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """[world_size, 3] flags of every rank, on the collective device (no host sync)."""
        if self.layout.world_size == 1:
            return local.view(1, -1)
        gathered = [torch.zeros(3, dtype=torch.int32, device=local.device) for _ in range(self.layout.world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered)

    def _describe(self, iteration: int, flags: torch.Tensor, spike_message) -> str:
        problems = []
        if _ranks(flags, _LOSS):
            problems.append(f"non-finite loss on rank(s) {_ranks(flags, _LOSS)}")
        if _ranks(flags, _GRADS):
            where = ("before the data-parallel reduction" if self.local_grads_checked
                     else "(the global gradient norm)")
            problems.append(f"non-finite gradients on rank(s) {_ranks(flags, _GRADS)} {where}")
        if _ranks(flags, _SPIKE):
            # The loss is global: the ranks that hold it (last pipeline stage) all see the same spike.
            problems.append(f"loss spike: {spike_message}" if spike_message else "loss spike")
        return f"iteration {iteration}: " + "; ".join(problems)


def stop_on_bad_step(stop: BadStepStop, save=None) -> int:
    """Reports `stop`, saves the last good state with `save()` when given, returns the exit code."""
    print_rank_0(f"ERROR: {stop}")
    if save is not None:
        save()
        print_rank_0(f"saved the state after iteration {stop.iteration}, before the bad step; resume from it "
                     "(with a lower learning rate, other data order, or --bad-step-policy skip)")
    return EXIT_CODE_BAD_STEP
