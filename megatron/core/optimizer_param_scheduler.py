"""`OptimizerParamScheduler`: Megatron's learning-rate and weight-decay schedules, counted in samples.

The training loop calls `step(increment=global_batch_size)` after every successful update, so `n`
below is the number of samples consumed. The scheduler is built with `step(0)`: the first update
uses lr(0), which is `init_lr` when there is a warm-up. With W warm-up and D decay steps, a group's
lr(n), between its `max_lr` and `min_lr`, is

    n <= W (W > 0)          init + (max - init) * n / W
    constant                max
    n > D                   min
    inverse-square-root     max(min, max * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    otherwise               min + c(r) * (max - min),  r = (n - W) / (D - W)
        linear   c = 1 - r
        cosine   c = (cos(pi r) + 1) / 2
        WSD      c = 1 until n = D - A (A = `wsd_decay_steps`), then with s = (n - (D - A)) / A:
                 exponential 2 * 0.5^s - 1, linear 1 - s, cosine (cos(pi s) + 1) / 2, minus_sqrt 1 - sqrt(s)

and the group's `lr` is lr(n) * `lr_mult`. Weight decay runs from `start_wd` to `end_wd` over
`wd_incr_steps` (constant, linear: t, cosine: (cos(pi (1 - t)) + 1) / 2 with t = n / steps) and
each group gets wd(n) * `wd_mult` (0 for biases and norms).
"""

import logging
import math
from typing import Optional

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _wsd_anneal_coefficient(style: str, ratio: float) -> float:
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return 1.0 - math.sqrt(ratio)


class OptimizerParamScheduler:
    """Sets `lr` and `weight_decay` of every param group of `optimizer` as training consumes samples.

    Steps (`lr_warmup_steps`, `lr_decay_steps`, `wsd_decay_steps`, `wd_incr_steps`) are sample counts;
    the caller converts `--lr-warmup-iters`/`--lr-warmup-fraction`/`--lr-decay-iters` into samples.
    Per-group `max_lr`/`min_lr` (the decoupled embedding/output LR) override `max_lr`/`min_lr`.
    """

    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self._validate()
        self.num_steps = 0
        self.step(0)
        logger.info("> learning rate decay style: %s", self.lr_decay_style)

    def _validate(self) -> None:
        problems = []
        if self.min_lr < 0.0:
            problems.append(f"min lr (--min-lr) must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            problems.append(f"lr (--lr) {self.max_lr} must be >= min lr (--min-lr) {self.min_lr}")
        if self.init_lr > self.max_lr:
            problems.append(f"warm-up initial lr (--lr-warmup-init) {self.init_lr} must be <= lr (--lr) {self.max_lr}")
        if self.lr_decay_steps <= 0:
            problems.append(f"lr decay steps must be positive, got {self.lr_decay_steps} samples")
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            problems.append(
                f"lr warm-up ({self.lr_warmup_steps} samples) must be >= 0 and shorter than the lr decay "
                f"({self.lr_decay_steps} samples): check --lr-warmup-* against --lr-decay-* / --train-*"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            problems.append(
                f"lr decay style (--lr-decay-style) {self.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}"
            )
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or self.wsd_decay_steps <= 0:
                problems.append(
                    f"WSD needs a positive anneal length (--lr-wsd-decay-iters/-samples), got {self.wsd_decay_steps}"
                )
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                problems.append(
                    f"WSD anneal style (--lr-wsd-decay-style) {self.lr_wsd_decay_style!r} is not one of "
                    f"{', '.join(WSD_DECAY_STYLES)}"
                )
        if self.start_wd < 0.0:
            problems.append(f"start weight decay (--start-weight-decay) must be >= 0, got {self.start_wd}")
        if self.end_wd < self.start_wd:
            problems.append(f"end weight decay {self.end_wd} must be >= start weight decay {self.start_wd}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            problems.append(
                f"weight decay increment style (--weight-decay-incr-style) {self.wd_incr_style!r} is not one of "
                f"{', '.join(WD_INCR_STYLES)}"
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            problems.append(
                f"constant weight decay needs start = end weight decay, got {self.start_wd} and {self.end_wd}"
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            problems.append(
                "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler exclude each other"
            )
        if problems:
            raise ValueError("invalid learning-rate schedule: " + "; ".join(problems))

    def get_wd(self) -> float:
        """Weight decay after `num_steps` samples (before a group's `wd_mult`)."""
        # At n = wd_incr_steps every style has reached end_wd; `>=` also covers wd_incr_steps = 0.
        if self.num_steps >= self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate of `param_group` after `num_steps` samples (before its `lr_mult`)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / num_steps**0.5)

        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                anneal_ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = _wsd_anneal_coefficient(self.lr_wsd_decay_style, anneal_ratio)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advances by `increment` samples and writes `lr`/`weight_decay` into every param group."""
        self.num_steps += increment
        weight_decay = self.get_wd()
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.get_lr(param_group) * param_group.get("lr_mult", 1.0)
            param_group["weight_decay"] = weight_decay * param_group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        """The schedule and its position, with Megatron's checkpoint keys."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, run_value, checkpoint_value, name: str, unit: str = ""):
        """The value to continue with, under --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler."""
        if self.override_opt_param_scheduler:
            logger.info(" > overriding %s value to %s", name, run_value)
            return run_value
        if not self.use_checkpoint_opt_param_scheduler and run_value != checkpoint_value:
            unit = f" {unit}" if unit else ""
            raise ValueError(
                f"OptimizerParamScheduler: the checkpoint's {name} is {checkpoint_value}{unit} but this run's is "
                f"{run_value}{unit}; pass --override-opt-param-scheduler to use this run's values or "
                "--use-checkpoint-opt-param-scheduler to use the checkpoint's"
            )
        logger.info(" > using checkpoint value %s for %s", checkpoint_value, name)
        return checkpoint_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the schedule position (and, by the rules above, its settings) from a checkpoint.

        Accepts the key names of older Megatron checkpoints (`start_lr`, `warmup_iter`, `end_iter`,
        `decay_style`, `num_iters`, ...).
        """

        def saved(*keys):
            return next(state_dict[key] for key in keys if key in state_dict)

        self.max_lr = self._check_and_set(self.max_lr, saved("start_lr", "max_lr"), "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "minimum learning rate")
        # Lengths are counted in samples: --lr-*-iters x the global batch size, or --lr-*-samples.
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, saved("warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "learning-rate warm-up (--lr-warmup-iters x global batch size, --lr-warmup-samples or "
            "--lr-warmup-fraction)", unit="samples",
        )
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, saved("end_iter", "decay_steps", "lr_decay_steps"),
            "learning-rate decay length (--lr-decay-iters, by default --train-iters, x global batch size, or "
            "--lr-decay-samples)", unit="samples",
        )
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, saved("decay_style", "lr_decay_style"), "learning rate decay style"
        )
        if "start_wd" in state_dict:
            self.start_wd = self._check_and_set(self.start_wd, state_dict["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, state_dict["end_wd"], "end weight decay")
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, state_dict["wd_incr_style"], "weight decay incr style"
            )
            if self.wd_incr_style != "constant":  # a constant weight decay has no ramp whose length could differ
                self.wd_incr_steps = self._check_and_set(
                    self.wd_incr_steps, state_dict["wd_incr_steps"],
                    "weight-decay ramp length (--train-iters x global batch size, or --train-samples)", unit="samples",
                )
            elif self.use_checkpoint_opt_param_scheduler and not self.override_opt_param_scheduler:
                self.wd_incr_steps = state_dict["wd_incr_steps"]  # unused, kept as Megatron-LM keeps it
        self.num_steps = 0
        self.step(saved("num_iters", "num_steps"))
