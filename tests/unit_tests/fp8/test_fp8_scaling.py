"""Delayed scaling against a hand computation of Transformer Engine's rules (megatron/core/fp8/scaling.py):
the amax recorded in a step, the history roll, "most_recent" vs "max" over an amax_history_len of 3, the
margin, and the cases that keep the old scale. All values are exact in fp32, so the comparisons are exact."""

import pytest
import torch

from megatron.core.fp8 import Fp8Recipe, Fp8Scaling, fp8_linear, update_fp8_scaling
from megatron.core.fp8.scaling import INPUT, WEIGHT

# max |x| of the input in steps 1..5
AMAXES = [2.0, 8.0, 4.0, 1.0, 1.0]
# History rows 1..3 (input column) after each step's update: row 1 is zeroed for the next step, rows 2..3
# hold the previous steps' amaxes, oldest first (TE's roll by -1).
HISTORIES = [[0, 0, 2], [0, 2, 8], [0, 8, 4], [0, 4, 1], [0, 1, 1]]
# scale = 448 / amax / 2^margin (margin 1): from the last step's amax, or from the max over the last 3 steps.
SCALES = {
    "most_recent": [448 / 2 / 2, 448 / 8 / 2, 448 / 4 / 2, 448 / 1 / 2, 448 / 1 / 2],
    "max": [448 / 2 / 2, 448 / 8 / 2, 448 / 8 / 2, 448 / 8 / 2, 448 / 4 / 2],
}


def _input_with_amax(amax: float) -> torch.Tensor:
    x = torch.linspace(-0.5 * amax, 0.25 * amax, 32).view(2, 16)
    x[1, 3] = -amax
    return x.bfloat16()


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_history_and_scales_follow_the_hand_computation(algo):
    scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed", margin=1, amax_history_len=3, amax_compute_algo=algo),
                         torch.device("cpu"))
    scale_in_use = 1.0
    for step, amax in enumerate(AMAXES):
        for x in (_input_with_amax(amax), _input_with_amax(amax / 2)):  # two microbatches: the max counts
            quantized = scaling.quantize(x, INPUT, record=True)
            assert quantized.scale.item() == scale_in_use  # the scale of the previous update
            assert quantized.scale_inv.item() == pytest.approx(1 / scale_in_use, rel=1e-7)
        assert scaling.meta[1, INPUT].item() == amax
        update_fp8_scaling([scaling])
        assert scaling.meta[1:, INPUT].tolist() == HISTORIES[step], step
        assert scaling.meta[0, INPUT].item() == pytest.approx(SCALES[algo][step], rel=1e-7), step
        scale_in_use = scaling.meta[0, INPUT].item()
    # The weight column never saw an amax: its scale stays 1.
    assert scaling.meta[0, WEIGHT].item() == 1.0


def test_history_of_length_one_is_this_step_only():
    scaling = Fp8Scaling(Fp8Recipe("e4m3", "delayed", amax_history_len=1, amax_compute_algo="max"), torch.device("cpu"))
    for amax in (8.0, 2.0):
        scaling.quantize(_input_with_amax(amax), INPUT, record=True)
        update_fp8_scaling([scaling])
        assert scaling.meta[:, INPUT].tolist() == [448 / amax, 0.0]


def test_zero_and_infinite_amax_keep_the_scale_and_tiny_amax_caps_it():
    scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed"), torch.device("cpu"))
    scaling.meta[0] = torch.tensor([3.0, 5.0, 7.0])
    scaling.meta[1] = torch.tensor([0.0, float("inf"), 1e-45])
    update_fp8_scaling([scaling])
    assert scaling.meta[0].tolist() == [3.0, 5.0, torch.finfo(torch.float32).max]


def test_recomputed_forward_and_evaluation_leave_the_amaxes_as_they_are():
    scaling = Fp8Scaling(Fp8Recipe("hybrid", "delayed"), torch.device("cpu"))
    weight = torch.randn(16, 32, dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    fp8_linear(x, weight, None, scaling)
    once = scaling.meta.clone()
    fp8_linear(x, weight, None, scaling)  # activation recomputation repeats the forward exactly
    assert torch.equal(scaling.meta, once)
    scaling.eval()
    fp8_linear(10 * x, weight, None, scaling)
    assert torch.equal(scaling.meta, once)
    assert once[1, INPUT] == x.abs().max() and once[1, WEIGHT] == weight.abs().max()


def test_update_handles_many_gemms_at_once_and_each_keeps_its_own_state():
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=2)
    scalings = [Fp8Scaling(recipe, torch.device("cpu")) for _ in range(3)]
    for index, scaling in enumerate(scalings):
        scaling.quantize(_input_with_amax(2.0 ** index), INPUT, record=True)
    update_fp8_scaling([torch.nn.ModuleList(scalings)])
    assert [scaling.meta[0, INPUT].item() for scaling in scalings] == [448.0, 224.0, 112.0]
    assert [scaling.meta[2, INPUT].item() for scaling in scalings] == [1.0, 2.0, 4.0]


def test_state_stays_fp32_when_the_model_is_cast_to_bf16():
    module = torch.nn.Module()
    module.fp8 = Fp8Scaling(Fp8Recipe("hybrid", "delayed", amax_history_len=4), torch.device("cpu"))
    module.to(torch.bfloat16)
    assert module.fp8.meta.dtype == torch.float32 and module.fp8.meta.shape == (5, 3)


def test_tensorwise_keeps_no_state():
    scaling = Fp8Scaling(Fp8Recipe("e4m3", "tensorwise"), torch.device("cpu"))
    quantized = scaling.quantize(_input_with_amax(4.0), INPUT, record=True)
    assert scaling.meta is None and quantized.scale.item() == 448 / 4.0
    update_fp8_scaling([scaling])  # nothing to update
