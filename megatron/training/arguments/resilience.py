"""Flags for surviving faults and checking a run before it starts: bad steps (non-finite values, loss
spikes), resuming from the latest complete checkpoint, and the dry run.

Megatron's names where Megatron has the flag (--check-for-nan-in-loss-and-grad, --check-for-spiky-loss);
the others are this project's, documented in the README's flag section.
"""

import argparse

BAD_STEP_POLICIES = ("stop", "skip")


def _add_resilience_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="resilience")
    group.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                       dest="check_for_nan_in_loss_and_grad",
                       help="Check every rank's loss and gradients for NaN/Inf each iteration (default on; "
                            "--no-check-for-nan-in-loss-and-grad turns it off).")
    group.add_argument("--check-for-spiky-loss", action="store_true",
                       help="Treat a loss above --spiky-loss-factor x the recent mean as a bad step.")
    group.add_argument("--spiky-loss-factor", type=float, default=10.0,
                       help="A loss above this many times the mean of the last --spiky-loss-window "
                            "iterations is a spike (default 10).")
    group.add_argument("--spiky-loss-window", type=int, default=10,
                       help="Accepted iterations whose mean loss a new loss is compared with (default 10).")
    group.add_argument("--bad-step-policy", default="stop", choices=BAD_STEP_POLICIES,
                       help="On a non-finite loss/gradient or a loss spike: stop (save the last good state, "
                            "exit 17) or skip the update (up to --bad-step-skip-budget times, then stop).")
    group.add_argument("--bad-step-skip-budget", type=int, default=10,
                       help="Bad steps --bad-step-policy skip may skip in one run before it stops (default 10).")
    group.add_argument("--auto-resume", action="store_true",
                       help="Resume from the latest complete checkpoint in --save (--load defaults to --save); "
                            "start afresh when there is none.")
    group.add_argument("--dry-run", action="store_true",
                       help="Validate the arguments for WORLD_SIZE ranks, print the layout, parameters, memory "
                            "per GPU and FLOPs per iteration, and exit without training (no GPU needed).")
    return parser


def check_resilience(args, problems: list) -> None:
    """Validates the flags above; --auto-resume points --load at --save."""
    if args.spiky_loss_factor <= 1.0:
        problems.append(f"--spiky-loss-factor {args.spiky_loss_factor} must be above 1 (a loss this many times "
                        "the recent mean is a spike)")
    if args.spiky_loss_window < 1:
        problems.append(f"--spiky-loss-window {args.spiky_loss_window} must be at least 1")
    if args.bad_step_skip_budget < 0:
        problems.append(f"--bad-step-skip-budget {args.bad_step_skip_budget} must be >= 0")
    if args.auto_resume:
        if args.save is None:
            problems.append("--auto-resume resumes from --save: give --save DIR")
        elif args.load is None:
            args.load = args.save
        elif args.load != args.save:
            problems.append(f"--auto-resume resumes from --save {args.save}, but --load {args.load} names another "
                            "directory: drop one of --auto-resume and --load")
