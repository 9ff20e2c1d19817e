"""Bad training steps: non-finite loss or gradients on any rank, and loss spikes; what the run does about them.

Every iteration, between the backward pass and the optimizer step, each rank checks what only it can see:

    loss      its own microbatch loss sums, before any reduction          (--check-for-nan-in-loss-and-grad)
    grads     its own gradients before the data-parallel reduction, recorded by the finalize hook below;
              with --overlap-grad-reduce the reduction is already under way then, so the gradients are
              checked after it and the rank they came from cannot be told
    spike     the global loss against the mean of the last --spiky-loss-window accepted steps
              (last pipeline stage only)                                  (--check-for-spiky-loss)

One all-gather of three flags per rank gives every rank the same picture, so all take the same branch:

    --bad-step-policy stop   print which rank saw what at which iteration, save a checkpoint of the last good
                             state (the bad update is never applied) and exit with code 17
    --bad-step-policy skip   leave weights, optimizer and scheduler untouched, count the iteration as skipped
                             (and as nan when something was non-finite); stop as above once more than
                             --bad-step-skip-budget iterations were skipped in this run
"""

import math

import torch
import torch.distributed as dist

from megatron.core.parallel_state import collective_device
from megatron.training.checkpoint.rng import get_rng_state, set_rng_state
from megatron.training.console import print_rank_0

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


def _all_finite(tensors) -> torch.Tensor:
    """One boolean tensor (no host sync): every entry of every tensor is finite."""
    verdicts = [torch.isfinite(tensor).all() for tensor in tensors]
    return torch.stack(verdicts).all() if verdicts else torch.tensor(True)


class BadStepGuard:
    """Applies the checks and the policy of the module docstring; one per training run."""

    def __init__(self, args, start_iteration: int):
        self.check_nonfinite = bool(args.check_for_nan_in_loss_and_grad)
        self.check_spikes = bool(args.check_for_spiky_loss)
        self.policy = args.bad_step_policy
        self.skip_budget = args.bad_step_skip_budget
        self.spike_factor = args.spiky_loss_factor
        self.spike_window = args.spiky_loss_window
        # With --overlap-grad-reduce the reduction starts inside backward, and a full-iteration CUDA graph
        # replays backward and reduction without running this Python: both are checked after the step.
        self.grads_before_reduction = not (args.overlap_grad_reduce or args.cuda_graph_impl == "full_iteration")
        self.iteration = start_iteration
        self.skipped = 0
        self.recent_losses = []
        self._local_grads_finite = None
        self.skipped_grad_norm = None  # reported for a skipped step: NaN when something was non-finite
        # The generators as they were before the step being inspected: a stop saves them, so that the
        # resumed run redoes that step with the same dropout masks.
        self._rng_before_step = get_rng_state(data_parallel_random_init=False) if self.enabled else None

    @property
    def enabled(self) -> bool:
        return self.check_nonfinite or self.check_spikes

    def wrap_finalize(self, finalize_model_grads_func, model: list):
        """`finalize_model_grads_func` that first records whether this rank's own gradients are finite."""
        if not (self.check_nonfinite and self.grads_before_reduction):
            return finalize_model_grads_func

        def finalize_after_local_check(*args, **kwargs):
            self._local_grads_finite = self._gradients_finite(model)
            return finalize_model_grads_func(*args, **kwargs)

        return finalize_after_local_check

    @staticmethod
    def _gradients_finite(model: list) -> torch.Tensor:
        """One check per contiguous gradient buffer of a DDP-wrapped chunk, one per parameter otherwise."""
        grads = []
        for chunk in model:
            if hasattr(chunk, "main_grad_buffers"):
                grads.extend(chunk.main_grad_buffers())
                continue
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                grads.append(grad if grad is not None else param.grad)
        return _all_finite([grad for grad in grads if grad is not None])

    def inspect(self, loss_reports: list, loss_dict: dict, model: list) -> bool:
        """Checks the step just computed (collective); True when its update must be skipped.

        `loss_reports` are this rank's per-microbatch reports before reduction, `loss_dict` the reduced
        losses (empty off the last pipeline stage). Raises BadStepStop when the run must stop.
        """
        self.iteration += 1
        if not self.enabled:
            return False
        local = torch.zeros(3, dtype=torch.int32)
        if self.check_nonfinite:
            local_losses = [torch.as_tensor(value).detach().float().view(-1)[:1]
                            for report in loss_reports for value in report.values()]
            local[_LOSS] = int(not bool(_all_finite(local_losses)))
            grads_finite = (self._local_grads_finite if self.grads_before_reduction
                            else self._gradients_finite(model))
            local[_GRADS] = int(grads_finite is not None and not bool(grads_finite))
            self._local_grads_finite = None
        spike_message = self._spike(loss_dict) if self.check_spikes else None
        local[_SPIKE] = int(spike_message is not None)
        flags = self._gather(local)
        if not flags.any():
            self._remember(loss_dict)
            self._rng_before_step = get_rng_state(data_parallel_random_init=False)
            return False
        self.skipped_grad_norm = float("nan") if flags[:, [_LOSS, _GRADS]].any() else None
        return self._apply_policy(self._describe(flags, spike_message))

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

    @staticmethod
    def _gather(local: torch.Tensor) -> torch.Tensor:
        """[world_size, 3] flags of every rank."""
        if not dist.is_initialized():
            return local.view(1, -1)
        device = collective_device()
        gathered = [torch.zeros(3, dtype=torch.int32, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local.to(device))
        return torch.stack(gathered).cpu()

    def _describe(self, flags: torch.Tensor, spike_message) -> str:
        problems = []
        if _ranks(flags, _LOSS):
            problems.append(f"non-finite loss on rank(s) {_ranks(flags, _LOSS)}")
        if _ranks(flags, _GRADS):
            where = ("before the data-parallel reduction" if self.grads_before_reduction
                     else "after the data-parallel reduction (--overlap-grad-reduce hides the rank of origin)")
            problems.append(f"non-finite gradients on rank(s) {_ranks(flags, _GRADS)} {where}")
        if _ranks(flags, _SPIKE):
            # The loss is global: the ranks that hold it (last pipeline stage) all see the same spike.
            problems.append(f"loss spike: {spike_message}" if spike_message else "loss spike")
        return f"iteration {self.iteration}: " + "; ".join(problems)

    def _apply_policy(self, description: str) -> bool:
        if self.policy == "skip" and self.skipped < self.skip_budget:
            self.skipped += 1
            print_rank_0(f"WARNING: bad step at {description}; skipping this update "
                         f"({self.skipped} of --bad-step-skip-budget {self.skip_budget} used)")
            self._rng_before_step = get_rng_state(data_parallel_random_init=False)
            return True
        reason = ("--bad-step-policy stop" if self.policy == "stop"
                  else f"--bad-step-skip-budget {self.skip_budget} is used up")
        set_rng_state({"rng_state": self._rng_before_step}, False, "the state before the bad step")
        raise BadStepStop(f"bad step at {description}; stopping ({reason})", self.iteration - 1)


def stop_on_bad_step(stop: BadStepStop, save=None) -> int:
    """Reports `stop`, saves the last good state with `save()` when given, returns the exit code."""
    print_rank_0(f"ERROR: {stop}")
    if save is not None:
        save()
        print_rank_0(f"saved the state after iteration {stop.iteration}, before the bad step; resume from it "
                     "(with a lower learning rate, other data order, or --bad-step-policy skip)")
    return EXIT_CODE_BAD_STEP
