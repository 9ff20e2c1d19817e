"""Flags for surviving faults and checking a run before it starts: bad steps (non-finite values, loss
spikes), resuming from the latest complete checkpoint, and the dry run.

Megatron's names where Megatron has the flag (--check-for-nan-in-loss-and-grad, --check-for-spiky-loss, the
re-run engine's --rerun-mode, --error-injection-rate, --error-injection-type);
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

    check_weight_hash_across_dp_replicas_interval: int | None = None
    """Every this many iterations, check that every data-parallel replica holds the same weights (a hash of
    each parameter, compared over the data-parallel group); a mismatch stops the run naming the parameter
    and the ranks."""

    rerun_mode: str | None = flag(None, choices=("disabled", "validate_results", "report_stats"))
    """Megatron-LM's re-run engine. validate_results: a loss that is NaN or Inf
    (--check-for-nan-in-loss-and-grad) or spiky (--check-for-spiky-loss: 10 x the largest of the rank's first
    100 losses) has its iteration re-run on the same data and random state before the update; a different
    result is a transient fault (exit 17 for NaN/Inf, training goes on for a spike), the same result saves a
    checkpoint of the state before the iteration and exits with 16 (NaN/Inf) or goes on (spike); gradients stay
    with the bad-step checks. disabled, or not given (unlike Megatron-LM, whose default is validate_results):
    no re-runs, --bad-step-policy handles bad steps. report_stats is not supported yet."""

    error_injection_rate: int = 0
    """Inject an unexpected result once every this many validations of the re-run engine (tests of the engine;
    needs --rerun-mode validate_results; 0: never)."""

    error_injection_type: str = flag("transient_error",
                                     choices=("correct_result", "transient_error", "persistent_error"))
    """The kind of error --error-injection-rate injects: transient_error (the re-run differs) or
    persistent_error (the re-run reproduces it); correct_result is not supported yet."""

    test_mode: bool = False
    """Check in every self-attention forward that the QK norms' params are identical on all data-parallel and
    tensor-parallel ranks (Megatron-LM's real-time self-test; stops on silent corruption)."""

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
        interval = self.check_weight_hash_across_dp_replicas_interval
        if interval is not None and interval < 1:
            problems.append(f"--check-weight-hash-across-dp-replicas-interval {interval} must be positive")
        if self.error_injection_rate < 0:
            problems.append(f"--error-injection-rate {self.error_injection_rate} must be >= 0")
        elif self.error_injection_rate > 0 and self.rerun_mode != "validate_results":
            problems.append(f"--error-injection-rate {self.error_injection_rate} injects errors into the re-run "
                            "engine's validations, which only run with --rerun-mode validate_results (Megatron-LM's "
                            f"default; here it must be given), not with --rerun-mode {self.rerun_mode}")
        if self.rerun_mode == "validate_results" and (self.spiky_loss_factor != 10.0 or self.spiky_loss_window != 10):
            problems.append("--spiky-loss-factor and --spiky-loss-window set the bad-step spike check, which "
                            "--rerun-mode validate_results replaces by Megatron-LM's (10 x the largest of a rank's "
                            "first 100 losses)")
        if self.bad_step_skip_budget < 0:
            problems.append(f"--bad-step-skip-budget {self.bad_step_skip_budget} must be >= 0")
        return problems
