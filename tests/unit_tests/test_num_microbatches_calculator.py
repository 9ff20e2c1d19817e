"""Microbatch calculator: constant and ramp-up arithmetic (Megatron's `--rampup-batch-size`) and its errors."""

import pytest
import torch.distributed as dist

from megatron.core import num_microbatches_calculator as calculator
from megatron.core import parallel_state


@pytest.fixture(autouse=True)
def fresh_calculator():
    calculator.destroy_num_microbatches_calculator()
    yield
    calculator.destroy_num_microbatches_calculator()


def test_constant_global_batch():
    calculator.init_num_microbatches_calculator(0, None, global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert calculator.get_num_microbatches() == 4
    assert calculator.get_current_global_batch_size() == 32
    assert calculator.get_current_running_global_batch_size() == 32
    assert calculator.get_micro_batch_size() == 2
    calculator.update_num_microbatches(10_000)
    assert calculator.get_num_microbatches() == 4


def test_rampup_hand_worked():
    # 4 -> 12 in increments of 4: two increments, one every 100 / 2 = 50 samples.
    calculator.init_num_microbatches_calculator(0, [4, 4, 100], global_batch_size=12, micro_batch_size=2,
                                                data_parallel_size=2)
    expected = {0: 4, 49: 4, 50: 8, 99: 8, 100: 12, 101: 12, 10**6: 12}
    for consumed, global_batch in expected.items():
        calculator.update_num_microbatches(consumed)
        assert calculator.get_current_global_batch_size() == global_batch, consumed
        assert calculator.get_num_microbatches() == global_batch // 4


def test_rampup_gpt3_example():
    # --rampup-batch-size 16 16 5859375 --global-batch-size 1536: 95 increments, 5859375 / 95 samples each.
    calculator.init_num_microbatches_calculator(0, [16, 16, 5859375], global_batch_size=1536, micro_batch_size=1,
                                                data_parallel_size=8)
    per_increment = 5859375 / 95
    assert calculator.get_current_global_batch_size() == 16 and calculator.get_num_microbatches() == 2
    for consumed in [61677, 61678, 3_000_000, 5_859_374, 5_859_375, 5_859_376]:
        calculator.update_num_microbatches(consumed)
        expected = 1536 if consumed > 5859375 else 16 + int(consumed / per_increment) * 16
        assert calculator.get_current_global_batch_size() == expected
        assert calculator.get_num_microbatches() == expected // 8
    calculator.update_num_microbatches(61678)
    assert calculator.get_current_global_batch_size() == 32


def test_decrease_batch_size_if_needed_rounds_down():
    calculator.init_num_microbatches_calculator(0, None, 10, 4, 2, decrease_batch_size_if_needed=True)
    assert calculator.get_current_global_batch_size() == 10
    assert calculator.get_current_running_global_batch_size() == 8
    assert calculator.get_num_microbatches() == 1


def test_indivisible_global_batch_shows_the_arithmetic_and_the_ways_out():
    with pytest.raises(ValueError) as error:
        calculator.init_num_microbatches_calculator(0, None, global_batch_size=10, micro_batch_size=4,
                                                    data_parallel_size=2)
    message = str(error.value)
    assert "global batch size 10 is not divisible by micro batch size (4) x data-parallel size (2) = 8" in message
    assert "global batch = micro batch size x number of microbatches x data-parallel size" in message
    assert "8 (1 microbatch), 16 (2 microbatches)" in message
    assert "micro batch sizes that fit 10 at data-parallel size 2: 1, 5" in message
    assert "--decrease-batch-size-if-needed" in message


def test_global_batch_not_divisible_by_data_parallel_size_says_so():
    with pytest.raises(ValueError, match="no micro batch size fits 10: it is not divisible by the data-parallel size"):
        calculator.init_num_microbatches_calculator(0, None, 10, 1, 4)


def test_decrease_cannot_go_below_one_microbatch():
    with pytest.raises(ValueError, match="smaller than micro batch size"):
        calculator.init_num_microbatches_calculator(0, None, 6, 4, 2, decrease_batch_size_if_needed=True)


def test_rampup_sizes_are_all_checked_up_front():
    with pytest.raises(ValueError) as error:
        calculator.init_num_microbatches_calculator(0, [16, 16, 5859375], 1536, micro_batch_size=4,
                                                    data_parallel_size=8)
    message = str(error.value)
    assert "ramp-up global batch sizes 16, 48, 80" in message
    assert "= 32" in message and "multiples of 32" in message


@pytest.mark.parametrize(
    "rampup, message",
    [
        ([16, 10, 100], "is not divisible by the batch size increment 10"),
        ([64, 16, 100], "exceeds the global batch size"),
        ([0, 16, 100], "START > 0"),
        ([16, 16], "three numbers"),
    ],
)
def test_invalid_rampup(rampup, message):
    with pytest.raises(ValueError, match=message):
        calculator.init_num_microbatches_calculator(0, rampup, 32, 1, 1)


def test_lifecycle_errors_and_reconfigure():
    with pytest.raises(RuntimeError, match="not initialised"):
        calculator.get_num_microbatches()
    calculator.init_num_microbatches_calculator(0, None, 8, 1, 1)
    with pytest.raises(RuntimeError, match="already initialised"):
        calculator.init_num_microbatches_calculator(0, None, 8, 1, 1)
    calculator.reconfigure_num_microbatches_calculator(0, None, 16, 2, 1)
    assert calculator.get_num_microbatches() == 8


def test_error_shows_how_the_data_parallel_size_was_derived():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        derivation = r"data-parallel size 1 = world size 1 / \(tensor 1 x pipeline 1 x context 1 parallel\)"
        with pytest.raises(ValueError, match=derivation):
            calculator.init_num_microbatches_calculator(0, None, global_batch_size=3, micro_batch_size=2,
                                                        data_parallel_size=1)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_step_schedule_parsed_as_megatron():
    # Megatron-LM's 15B release schedule at sequence length 4096: thresholds in tokens, 200e9 // 4096 samples.
    assert calculator.parse_step_batch_size_schedule("0:384 200B:768 400B:1152", 4096) == [
        (0, 384), (48_828_125, 768), (97_656_250, 1152)]
    # Commas separate too, lower-case suffixes and decimals are read, the entries are sorted; no sequence
    # length: thresholds are samples.
    assert calculator.parse_step_batch_size_schedule("2.5k:32,0:16", None) == [(0, 16), (2500, 32)]


@pytest.mark.parametrize("schedule, seq_length, message", [
    ("", None, "is empty"),
    ("0:16 100", None, "entry '100' is not THRESHOLD:BATCH_SIZE"),
    ("0:16 1x:32", None, "'1X' is not a number"),
    ("10:16", None, "the first threshold must be 0, got 10 samples"),
    # 0 and 63 tokens are both sample 0 at sequence length 64.
    ("0:16 63:32", 64, "thresholds must strictly increase, [0] samples (tokens // sequence length 64) repeat"),
    ("0:16 1K:0", None, "batch size 0 must be positive"),
])
def test_invalid_step_schedule(schedule, seq_length, message):
    with pytest.raises(ValueError) as error:
        calculator.parse_step_batch_size_schedule(schedule, seq_length)
    assert message in str(error.value)


def test_step_schedule_calculator():
    # Thresholds at 128 and 384 tokens of 64: samples 2 and 6.
    calculator.init_num_microbatches_calculator(0, None, 4, micro_batch_size=2, data_parallel_size=2,
                                                step_batch_size_schedule="0:4 128:8 384:12", seq_length=64)
    seen = []
    for consumed in (0, 1, 2, 5, 6, 10**6):
        calculator.update_num_microbatches(consumed)
        seen.append((calculator.get_current_global_batch_size(), calculator.get_num_microbatches()))
    assert seen == [(4, 1), (4, 1), (8, 2), (8, 2), (12, 3), (12, 3)]
    # A step that is no whole number of microbatches stops the run where it is reached (not up front: an early
    # step may predate the layout of a resumed run).
    calculator.reconfigure_num_microbatches_calculator(0, None, 4, 2, 2, step_batch_size_schedule="0:4 100:6")
    with pytest.raises(ValueError, match="global batch size 6 is not divisible by micro batch size"):
        calculator.update_num_microbatches(100)
    with pytest.raises(ValueError, match="not both"):
        calculator.reconfigure_num_microbatches_calculator(0, [4, 4, 100], 12, 2, 2, step_batch_size_schedule="0:4")
