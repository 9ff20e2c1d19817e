"""OptimizerParamScheduler against the closed-form schedules of Megatron-LM's `get_lr`."""

import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

MAX_LR, MIN_LR, INIT_LR = 1e-3, 1e-4, 1e-5
WARMUP, DECAY, ANNEAL = 100, 1000, 200


def make_optimizer(*extra_groups):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    groups += [{"params": [torch.nn.Parameter(torch.zeros(2))], **extra} for extra in extra_groups]
    return torch.optim.SGD(groups, lr=0.0)


def make_scheduler(optimizer, style, warmup=WARMUP, init_lr=INIT_LR, **kwargs):
    settings = dict(
        init_lr=init_lr, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=warmup, lr_decay_steps=DECAY,
        lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=DECAY, wd_incr_style="constant",
    )
    settings.update(kwargs)
    return OptimizerParamScheduler(optimizer, **settings)


def reference_lr(n, style, warmup=WARMUP, init_lr=INIT_LR, max_lr=MAX_LR, min_lr=MIN_LR, wsd_style=None):
    """The reference formulas, written out independently of the implementation."""
    if warmup > 0 and n <= warmup:
        return init_lr + (max_lr - init_lr) * n / warmup
    if style == "constant":
        return max_lr
    if n > DECAY:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    r = (n - warmup) / (DECAY - warmup)
    if style == "linear":
        coeff = 1 - r
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * r) + 1)
    else:
        start = DECAY - ANNEAL
        if n <= start:
            coeff = 1.0
        else:
            s = (n - start) / ANNEAL
            coeff = {
                "exponential": 2 * 0.5**s - 1,
                "linear": 1 - s,
                "cosine": 0.5 * (math.cos(math.pi * s) + 1),
                "minus_sqrt": 1 - math.sqrt(s),
            }[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


SAMPLE_POINTS = [0, 1, 50, 99, 100, 101, 250, 500, 799, 800, 801, 900, 999, 1000, 1001, 5000]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_follows_the_closed_form_at_every_sample_count(style):
    optimizer = make_optimizer()
    scheduler = make_scheduler(optimizer, style)
    previous = 0
    for n in SAMPLE_POINTS:
        scheduler.step(n - previous)
        previous = n
        assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_lr(n, style), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_is_stable_then_anneals_in_its_last_steps(wsd_style):
    optimizer = make_optimizer()
    scheduler = make_scheduler(optimizer, "WSD", wsd_decay_steps=ANNEAL, lr_wsd_decay_style=wsd_style)
    previous = 0
    for n in SAMPLE_POINTS:
        scheduler.step(n - previous)
        previous = n
        expected = reference_lr(n, "WSD", wsd_style=wsd_style)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    scheduler.num_steps = 800
    scheduler.step(0)
    assert optimizer.param_groups[0]["lr"] == MAX_LR


def test_counts_samples_hand_worked_example():
    # lr 1.0, warm-up 4 samples from 0, linear decay to 0 at 12 samples, global batch 2 samples.
    optimizer = make_optimizer()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=4, lr_decay_steps=12,
        lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=12, wd_incr_style="constant",
    )
    seen = [optimizer.param_groups[0]["lr"]]  # what the first update uses: lr(0) = warm-up init
    for _ in range(7):
        scheduler.step(increment=2)
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert scheduler.num_steps == 14


def test_without_warmup_step_zero_uses_the_peak_lr():
    optimizer = make_optimizer()
    make_scheduler(optimizer, "cosine", warmup=0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(MAX_LR)


def test_decoupled_groups_use_their_own_range_and_lr_mult_scales():
    decoupled = {"max_lr": 5e-3, "min_lr": 5e-4}
    optimizer = make_optimizer(decoupled, {"lr_mult": 0.5})
    scheduler = make_scheduler(optimizer, "cosine")
    scheduler.step(400)
    default, embedding, scaled = optimizer.param_groups
    assert default["lr"] == pytest.approx(reference_lr(400, "cosine"))
    assert embedding["lr"] == pytest.approx(reference_lr(400, "cosine", max_lr=5e-3, min_lr=5e-4))
    assert scaled["lr"] == pytest.approx(0.5 * reference_lr(400, "cosine"))


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment_and_wd_mult(style):
    optimizer = make_optimizer({"wd_mult": 0.0})
    scheduler = make_scheduler(optimizer, "linear", start_wd=0.0, end_wd=0.1, wd_incr_steps=400, wd_incr_style=style)
    for n, t in [(0, 0.0), (100, 0.25), (200, 0.5), (400, 1.0), (800, 1.0)]:
        scheduler.num_steps = n
        scheduler.step(0)
        coeff = t if style == "linear" else 0.5 * (math.cos(math.pi * (1 - t)) + 1)
        assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1 * coeff)
        assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_state_dict_round_trip_continues_identically():
    first = make_optimizer()
    scheduler = make_scheduler(first, "cosine", use_checkpoint_opt_param_scheduler=False)
    scheduler.step(320)
    state = scheduler.state_dict()
    assert state["num_steps"] == 320 and state["max_lr"] == MAX_LR and state["lr_decay_style"] == "cosine"

    second = make_optimizer()
    resumed = make_scheduler(second, "cosine", use_checkpoint_opt_param_scheduler=False)
    resumed.load_state_dict(state)
    assert second.param_groups[0]["lr"] == first.param_groups[0]["lr"]
    for _ in range(3):
        scheduler.step(64)
        resumed.step(64)
        assert second.param_groups[0]["lr"] == first.param_groups[0]["lr"]


def test_mismatched_checkpoint_rules():
    saved = make_scheduler(make_optimizer(), "cosine")
    saved.step(500)
    state = saved.state_dict()

    strict = make_scheduler(make_optimizer(), "cosine", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="--override-opt-param-scheduler.*--use-checkpoint-opt-param-scheduler"):
        strict.load_state_dict(state)

    optimizer = make_optimizer()
    override = make_scheduler(
        optimizer, "cosine", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True
    )
    override.load_state_dict(state)
    assert override.max_lr == 2e-3 and override.num_steps == 500
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_lr(500, "cosine", max_lr=2e-3))

    from_checkpoint = make_scheduler(make_optimizer(), "linear", max_lr=2e-3, use_checkpoint_opt_param_scheduler=True)
    from_checkpoint.load_state_dict(state)
    assert from_checkpoint.max_lr == MAX_LR and from_checkpoint.lr_decay_style == "cosine"


def test_loads_legacy_checkpoint_keys():
    optimizer = make_optimizer()
    scheduler = make_scheduler(optimizer, "linear", use_checkpoint_opt_param_scheduler=False)
    legacy = {"start_lr": MAX_LR, "min_lr": MIN_LR, "warmup_iter": WARMUP, "end_iter": DECAY,
              "decay_style": "linear", "num_iters": 300}
    scheduler.load_state_dict(legacy)
    assert scheduler.num_steps == 300
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_lr(300, "linear"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr_decay_style": "triangle"}, "triangle"),
        ({"lr_warmup_steps": DECAY}, "warm-up"),
        ({"lr_decay_style": "WSD"}, "WSD needs"),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 10, "lr_wsd_decay_style": "step"}, "step"),
        ({"min_lr": 2e-3}, "min lr"),
        ({"wd_incr_style": "constant", "start_wd": 0.0, "end_wd": 0.1}, "constant weight decay"),
        ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True}, "exclude"),
    ],
)
def test_invalid_settings_are_reported(kwargs, message):
    settings = dict(
        init_lr=0.0, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
        lr_decay_style="linear", start_wd=0.1, end_wd=0.1, wd_incr_steps=DECAY, wd_incr_style="constant",
    )
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        OptimizerParamScheduler(make_optimizer(), **settings)
