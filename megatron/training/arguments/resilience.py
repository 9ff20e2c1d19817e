"""Validation of the resilience flags (megatron/training/config/resilience.py)."""


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
