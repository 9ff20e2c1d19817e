"""Flags for surviving faults and checking a run before it starts: bad steps (non-finite values, loss
spikes), resuming from the latest complete checkpoint, and the dry run.

Megatron's names where Megatron has the flag (--check-for-nan-in-loss-and-grad, --check-for-spiky-loss);
the others are this project's, documented in the README's flag section.
"""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag

BAD_STEP_POLICIES = ("stop", "skip")


@dataclass(kw_only=True)
class ResilienceConfig(Section):
    """Bad-step checks and policies, resuming, and the dry run."""

    TITLE = "resilience"

    check_for_nan_in_loss_and_grad: bool = flag(True, action="store_true",
                                                off=("--no-check-for-nan-in-loss-and-grad",))
    """Check every rank's loss and gradients for NaN/Inf each iteration (default on;
    --no-check-for-nan-in-loss-and-grad turns it off; off automatically with fp16 dynamic scaling)."""

    check_for_spiky_loss: bool = False
    """Treat a loss above --spiky-loss-factor x the recent mean as a bad step."""

    spiky_loss_factor: float = 10.0
    """A loss above this many times the mean of the last --spiky-loss-window iterations is a spike (default
    10)."""

    spiky_loss_window: int = 10
    """Accepted iterations whose mean loss a new loss is compared with (default 10)."""

    bad_step_policy: str = flag("stop", choices=BAD_STEP_POLICIES)
    """On a non-finite loss/gradient or a loss spike: stop (save the last good state, exit 17) or skip the
    update (up to --bad-step-skip-budget times, then stop)."""

    bad_step_skip_budget: int = 10
    """Bad steps --bad-step-policy skip may skip in one run before it stops (default 10)."""

    auto_resume: bool = False
    """Resume from the latest complete checkpoint in --save (--load defaults to --save); start afresh when
    there is none."""

    dry_run: bool = False
    """Validate the arguments for WORLD_SIZE ranks, print the layout, parameters, memory per GPU and FLOPs per
    iteration, and exit without training (no GPU needed)."""

    def validate(self) -> list[str]:
        problems = []
        if self.spiky_loss_factor <= 1.0:
            problems.append(f"--spiky-loss-factor {self.spiky_loss_factor} must be above 1 (a loss this many times "
                            "the recent mean is a spike)")
        if self.spiky_loss_window < 1:
            problems.append(f"--spiky-loss-window {self.spiky_loss_window} must be at least 1")
        if self.bad_step_skip_budget < 0:
            problems.append(f"--bad-step-skip-budget {self.bad_step_skip_budget} must be >= 0")
        return problems
