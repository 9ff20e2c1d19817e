"""tools/megatron_interop/make_fixtures.py judges Megatron-LM's resume of a checkpoint by the lm loss its
console prints, which for a run's second iteration is the mean of its first two (Megatron-LM's training_log
does not reset its loss sums after a run's first iteration). The numbers are those of a GPU run
(Megatron-LM d98e8a64 resuming this project's torch-fp32-adam-tp1 iteration-10 checkpoint; our
uninterrupted CPU run): every state was carried exactly, and only iteration 12's line differs, by
(loss 11 + loss 12) / 2."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "megatron_interop"))
from make_fixtures import compare, megatron_logged  # noqa: E402

OURS = {11: [5.619040, 0.782], 12: [5.635040, 0.677], 13: [5.617311, 0.659], 14: [5.621741, 0.687],
        15: [5.592920, 0.771], 16: [5.620723, 0.675], 17: [5.488751, 0.620], 18: [5.551615, 0.579],
        19: [5.557102, 0.611], 20: [5.544605, 0.755]}
MEGATRON_RESUMED = {**OURS, 12: [5.627040, 0.677]}


def test_second_iteration_of_a_run_is_logged_as_the_mean_of_the_first_two():
    logged = megatron_logged(OURS, 11)
    assert logged[12] == pytest.approx((5.619040 + 5.635040) / 2)
    assert all(logged[i] == OURS[i][0] for i in OURS if i != 12)
    assert megatron_logged(OURS, 1) == {i: values[0] for i, values in OURS.items()}  # 1 and 2 not there


def test_megatron_resume_of_our_checkpoint_is_exact_once_its_log_is_read_right():
    result = compare(OURS, MEGATRON_RESUMED, rtol=1e-5)
    assert result["passed"] and result["max_rel_loss_diff"] < 1e-7
    off = {**MEGATRON_RESUMED, 15: [5.592920 * (1 + 2e-5), 0.771]}
    result = compare(OURS, off, rtol=1e-5)
    assert not result["passed"] and result["max_rel_loss_diff"] == pytest.approx(2e-5, rel=1e-3)
    assert compare(OURS, {i: v for i, v in MEGATRON_RESUMED.items() if i != 20}, 1e-5) == {
        "passed": False, "missing_iterations": [20]}
