"""Loss scalers: Megatron's hysteresis and growth rules, worked out step by step."""

import pytest
import torch

from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


def make_dynamic(initial=2.0**16, window=3, hysteresis=2, min_scale=1.0):
    return DynamicGradScaler(
        initial_scale=initial, min_scale=min_scale, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=window, hysteresis=hysteresis, device="cpu",
    )


def test_overflows_halve_only_after_hysteresis_is_used_up():
    scaler = make_dynamic()
    scales = []
    for found_inf in [True, True, True, False, True]:
        scaler.update(found_inf)
        scales.append(scaler.scale.item())
    # 1st overflow spends the hysteresis budget of 2, 2nd and later ones halve; a clean step in
    # between does not refill the budget (only a growth does).
    assert scales == [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**13]
    assert scaler.inv_scale.item() == 2.0**-13


def test_growth_after_a_clean_window_refills_hysteresis():
    scaler = make_dynamic()
    scaler.update(True)  # budget 2 -> 1
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale.item() == 2.0**17
    scaler.update(True)  # budget was refilled to 2: no halving yet
    assert scaler.scale.item() == 2.0**17
    scaler.update(True)
    assert scaler.scale.item() == 2.0**16


def test_an_overflow_restarts_the_growth_window():
    scaler = make_dynamic(hysteresis=5)
    for found_inf in [False, False, True, False, False]:
        scaler.update(found_inf)
    assert scaler.scale.item() == 2.0**16
    scaler.update(False)
    assert scaler.scale.item() == 2.0**17


def test_scale_never_drops_below_min():
    scaler = make_dynamic(initial=4.0, hysteresis=1, min_scale=2.0)
    for _ in range(4):
        scaler.update(True)
    assert scaler.scale.item() == 2.0


def test_state_round_trip():
    scaler = make_dynamic()
    for found_inf in [True, False, False]:
        scaler.update(found_inf)
    restored = make_dynamic()
    restored.load_state_dict(scaler.state_dict())
    for found_inf in [True, True, False, False, False]:
        scaler.update(found_inf)
        restored.update(found_inf)
        assert torch.equal(restored.scale, scaler.scale)


def test_constant_scaler_never_moves():
    scaler = ConstantGradScaler(128.0, device="cpu")
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale.item() == 128.0 and scaler.state_dict() == {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_scale": 2.0**20}, "min loss scale"),
        ({"hysteresis": 0}, "--hysteresis"),
        ({"window": 0}, "--loss-scale-window"),
        ({"initial": -1.0}, "positive"),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_dynamic(**kwargs)
