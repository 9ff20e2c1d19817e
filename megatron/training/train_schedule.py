"""How long a run trains and how its learning rate and weight decay move, derived once from the arguments.

A run is given in iterations (`--train-iters`, the schedule's lengths in `--lr-*-iters`) or in samples
(`--train-samples`, `--lr-*-samples`). The scheduler (megatron/core/optimizer_param_scheduler.py) always counts
samples, so lengths given in iterations are multiplied by the global batch size:

    given in iterations                           given in samples
    train_iters     --train-iters                 --train-samples walked through the batch plan (ramp-up)
    decay           (--lr-decay-iters or          --lr-decay-samples or --train-samples
                     --train-iters) x GBS
    warmup          --lr-warmup-fraction x decay, else --lr-warmup-iters x GBS  /  --lr-warmup-samples
    wd increments   --train-iters x GBS           --train-samples
    WSD decay       --lr-wsd-decay-iters x GBS    --lr-wsd-decay-samples

`publish` writes the derived values back under the argument names Megatron-LM fills in (`args.train_iters`
for a run given in samples, `args.lr_decay_iters` / `args.lr_decay_samples` when not given), for code written
against Megatron-LM that reads them there and for the `args` a checkpoint records.
"""

from dataclasses import dataclass

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.batch_plan import BatchPlan
from megatron.training.console import print_rank_0


@dataclass(frozen=True)
class TrainingSchedule:
    """The run's length and the scheduler's step counts, in samples (module docstring)."""

    train_iters: int
    lr_warmup_steps: float
    lr_decay_steps: int
    wd_incr_steps: int
    lr_wsd_decay_steps: int | None
    # The argument values Megatron derives when they are not given (module docstring); None: given, or n/a.
    derived_lr_decay_iters: int | None = None
    derived_lr_decay_samples: int | None = None

    @classmethod
    def from_args(cls, args, plan: BatchPlan) -> "TrainingSchedule":
        if args.train_iters:
            lr_decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
            decay = plan.samples(lr_decay_iters)
            return cls(
                train_iters=args.train_iters,
                lr_warmup_steps=(args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                                 else plan.samples(args.lr_warmup_iters)),
                lr_decay_steps=decay,
                wd_incr_steps=plan.samples(args.train_iters),
                lr_wsd_decay_steps=(None if args.lr_wsd_decay_iters is None
                                    else plan.samples(args.lr_wsd_decay_iters)),
                derived_lr_decay_iters=lr_decay_iters if args.lr_decay_iters is None else None,
            )
        train_iters = plan.train_iters(args.train_samples)
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        return cls(
            train_iters=train_iters,
            lr_warmup_steps=(args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                             else args.lr_warmup_samples),
            lr_decay_steps=decay,
            wd_incr_steps=args.train_samples,
            lr_wsd_decay_steps=args.lr_wsd_decay_samples,
            derived_lr_decay_samples=decay if args.lr_decay_samples is None else None,
        )

    def build_scheduler(self, optimizer, args) -> OptimizerParamScheduler:
        """The LR/WD scheduler over these lengths, with the rest of its settings from `args`."""
        return OptimizerParamScheduler(
            optimizer,
            init_lr=args.lr_warmup_init,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=self.lr_warmup_steps,
            lr_decay_steps=self.lr_decay_steps,
            lr_decay_style=args.lr_decay_style,
            start_wd=args.start_weight_decay,
            end_wd=args.end_weight_decay,
            wd_incr_steps=self.wd_incr_steps,
            wd_incr_style=args.weight_decay_incr_style,
            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=args.override_opt_param_scheduler,
            wsd_decay_steps=self.lr_wsd_decay_steps,
            lr_wsd_decay_style=args.lr_wsd_decay_style,
        )

    def publish(self, args) -> None:
        """Writes the derived values under Megatron's argument names (module docstring)."""
        if args.train_iters != self.train_iters:
            print_rank_0(f"setting training iterations to {self.train_iters}")
        args.train_iters = self.train_iters
        if self.derived_lr_decay_iters is not None:
            args.lr_decay_iters = self.derived_lr_decay_iters
        if self.derived_lr_decay_samples is not None:
            args.lr_decay_samples = self.derived_lr_decay_samples
