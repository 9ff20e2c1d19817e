"""The batch plan's arithmetic against hand-worked numbers (Megatron-LM's formulas), its agreement with the
process-wide microbatch calculator that Megatron code reads, and the schedule lengths derived from it."""

import pytest

from megatron.core import num_microbatches_calculator as calculator
from megatron.training.arguments import parse_args, validate_args
from megatron.training.batch_plan import BatchPlan, StepBatch
from megatron.training.train_schedule import TrainingSchedule

RAMP = BatchPlan(micro_batch_size=2, data_parallel_size=2, global_batch_size=12, rampup_batch_size=(4, 4, 100))


def test_constant_plan():
    plan = BatchPlan(micro_batch_size=4, data_parallel_size=2, global_batch_size=32)
    assert plan.num_microbatches == 4
    assert plan.step_batch(0) == plan.step_batch(10**9) == StepBatch(32, 32, 4)
    assert plan.samples(3) == 96
    # 1000 samples are 31 whole batches of 32 (992); the last 8 are dropped.
    assert plan.train_iters(1000) == 31


def test_decrease_batch_size_if_needed_trains_the_rounded_batch():
    plan = BatchPlan(micro_batch_size=4, data_parallel_size=2, global_batch_size=10, decrease_batch_size_if_needed=True)
    assert plan.step_batch(0) == StepBatch(global_batch_size=10, running_global_batch_size=8, num_microbatches=1)
    with pytest.raises(ValueError, match="global batch size 10 is not divisible by micro batch size"):
        BatchPlan(micro_batch_size=4, data_parallel_size=2, global_batch_size=10).step_batch(0)


def test_rampup_steps():
    # (12 - 4) / 4 = 2 increments over 100 samples: one every 50 samples; 12 once past 100.
    expected = {0: 4, 49: 4, 50: 8, 99: 8, 100: 12, 101: 12, 5000: 12}
    assert {consumed: RAMP.global_batch_size_at(consumed) for consumed in expected} == expected
    assert RAMP.step_batch(60) == StepBatch(8, 8, 2)
    # Megatron's GPT-3 example: 95 increments of 16, one every 5859375 / 95 = 61677.6 samples.
    gpt3 = BatchPlan(micro_batch_size=1, data_parallel_size=8, global_batch_size=1536, rampup_batch_size=(16, 16, 5859375))
    assert [gpt3.global_batch_size_at(consumed) for consumed in (0, 61677, 61678, 5859375, 5859376)] == [
        16, 16, 32, 1536, 1536]


def test_rampup_train_iters_walk_the_ramp_then_whole_batches():
    # The walk: 13 steps of 4 (0 -> 52), 6 steps of 8 (52 -> 100), the step at 100 of 12 (-> 112); then
    # (200 - 112) // 12 = 7 whole batches.
    assert RAMP.train_iters(200) == 13 + 6 + 1 + 7
    # Inside the ramp the step that crosses the sample count is counted (Megatron's `update_train_iters`).
    assert RAMP.train_iters(50) == 13
    consumed = 0
    for _ in range(RAMP.train_iters(200)):
        consumed += RAMP.step_batch(consumed).running_global_batch_size
    assert consumed <= 200 < consumed + RAMP.global_batch_size


def test_plan_agrees_with_the_calculator_megatron_code_reads():
    RAMP.install(rank=0)
    try:
        for consumed in range(0, 160, 4):
            RAMP.move_calculator(consumed)
            assert RAMP.step_batch(consumed) == StepBatch(calculator.get_current_global_batch_size(),
                                                          calculator.get_current_running_global_batch_size(),
                                                          calculator.get_num_microbatches())
    finally:
        calculator.destroy_num_microbatches_calculator()


def test_dataset_sizes_are_megatrons():
    plan = BatchPlan(micro_batch_size=2, data_parallel_size=1, global_batch_size=8)
    # train: iterations x GBS; validation: (100 // 10 + 1) evaluations of 2 batches; test: one pass.
    assert plan.dataset_sizes(100, None, 10, 2) == (800, 11 * 2 * 8, 2 * 8)
    assert plan.dataset_sizes(100, 777, None, 2) == (777, 2 * 8, 2 * 8)


def _args(*flags):
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 128").split()
    return validate_args(parse_args(args_list=[*base, *flags]))


def test_schedule_in_iterations():
    args = _args("--global-batch-size", "8", "--train-iters", "100", "--lr-warmup-iters", "10",
                 "--lr-wsd-decay-iters", "20")
    schedule = TrainingSchedule.from_args(args, BatchPlan.from_args(args))
    assert (schedule.train_iters, schedule.lr_warmup_steps, schedule.lr_decay_steps, schedule.wd_incr_steps,
            schedule.lr_wsd_decay_steps) == (100, 80, 800, 800, 160)
    assert args.lr_decay_iters is None
    schedule.publish(args)
    assert (args.train_iters, args.lr_decay_iters) == (100, 100)


def test_schedule_in_samples_with_a_ramp():
    args = _args("--global-batch-size", "12", "--rampup-batch-size", "4", "4", "100", "--train-samples", "200",
                 "--lr-warmup-fraction", "0.1")
    plan = BatchPlan.from_args(args)
    assert plan == BatchPlan(2, 1, 12, (4, 4, 100), eval_micro_batch_size=2, eval_global_batch_size=12)
    schedule = TrainingSchedule.from_args(args, plan)
    assert (schedule.train_iters, schedule.lr_warmup_steps, schedule.lr_decay_steps, schedule.wd_incr_steps) == (
        plan.train_iters(200), 20.0, 200, 200)
    schedule.publish(args)
    assert (args.train_iters, args.lr_decay_samples) == (plan.train_iters(200), 200)


def test_evaluation_batches():
    """Evaluation passes read --eval-global-batch-size in micro batches of --eval-micro-batch-size (each defaults
    to its training counterpart); the validation and test datasets are sized in evaluation global batches."""
    plan = BatchPlan(micro_batch_size=2, data_parallel_size=2, global_batch_size=16, eval_micro_batch_size=1,
                     eval_global_batch_size=4)
    assert (plan.eval_micro, plan.eval_global, plan.eval_num_microbatches) == (1, 4, 2)
    assert plan.dataset_sizes(train_iters=10, train_samples=None, eval_interval=5, eval_iters=3) == (160, 36, 12)
    default = BatchPlan(micro_batch_size=2, data_parallel_size=2, global_batch_size=16)
    assert (default.eval_micro, default.eval_global, default.eval_num_microbatches) == (2, 16, 4)


def test_sizes_that_do_not_divide_and_the_default_global_batch():
    """The argument validation's batch rules: micro batch x DP divides the global batch, the evaluation batch and
    each ramp-up step; an unset global batch is one microbatch per step."""
    assert BatchPlan(micro_batch_size=4, data_parallel_size=2, global_batch_size=32).size_problems("DP 2") == []
    assert BatchPlan(4, 2, 20).size_problems("DP 2") == [
        "global batch size 20 is not a multiple of micro batch size 4 x DP 2; nearest valid: 16 or 24"]
    assert BatchPlan(4, 2, 20, decrease_batch_size_if_needed=True).size_problems("DP 2") == []
    assert BatchPlan(2, 2, 16, eval_micro_batch_size=3, eval_global_batch_size=4).size_problems("DP 2") == [
        "--eval-global-batch-size 4 is not a multiple of --eval-micro-batch-size 3 x DP 2; nearest valid: 6"]
    assert BatchPlan(2, 1, 16, rampup_batch_size=(4, 5, 100)).size_problems("DP 1") == [
        "--rampup-batch-size: --global-batch-size 16 - start 4 = 12 must be a non-negative multiple of the "
        "increment 5", "--rampup-batch-size increment 5 is not a multiple of micro batch size 2 x DP 1"]
    unset = _args("--train-iters", "10")  # no --global-batch-size
    assert BatchPlan.from_args(unset) == BatchPlan(2, 1, 2, eval_micro_batch_size=2, eval_global_batch_size=2)
    unset.global_batch_size = None  # as the validation sees it before deriving it
    assert BatchPlan.from_args(unset, data_parallel_size=4).global_batch_size == 8


def test_step_schedule_plan_walks_megatrons_update_train_iters():
    # Steps of 2, 4 and 6 samples from sample 0, 2 and 6 on.
    plan = BatchPlan(micro_batch_size=2, data_parallel_size=1, global_batch_size=2,
                     step_batch_size_schedule=((0, 2), (2, 4), (6, 6)))
    assert [plan.step_batch(consumed) for consumed in (0, 2, 6, 12)] == [
        StepBatch(2, 2, 1), StepBatch(4, 4, 2), StepBatch(6, 6, 3), StepBatch(6, 6, 3)]
    # 0 -> 2 -> 6 -> 12: three steps; a partial last step counts (13 samples: a fourth step, to 18).
    assert (plan.train_iters(12), plan.train_iters(13)) == (3, 4)
    # The plain global batch stays micro batch x DP for what is counted in global batches.
    assert plan.samples(3) == 6


def test_step_schedule_arguments(monkeypatch):
    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 " \
            "--micro-batch-size 2 --train-samples 12 --lr 1e-3".split()
    schedule = ["--step-batch-size-schedule", "0:2 128:4 384:6"]
    args = validate_args(parse_args(args_list=[*flags, *schedule]))
    plan = BatchPlan.from_args(args)
    # 128 and 384 tokens at sequence length 64: samples 2 and 6.
    assert (args.global_batch_size, plan.step_batch_size_schedule) == (2, ((0, 2), (2, 4), (6, 6)))
    plan.install(rank=0)
    try:
        for consumed in (0, 2, 6):
            plan.move_calculator(consumed)
            assert plan.step_batch(consumed).num_microbatches == calculator.get_num_microbatches()
    finally:
        calculator.destroy_num_microbatches_calculator()
    with pytest.raises(ValueError) as error:
        validate_args(parse_args(args_list=[*flags, "--global-batch-size", "4",
                                            "--step-batch-size-schedule", "0:2 63:4"]))
    assert "--step-batch-size-schedule sets the global batch: drop --global-batch-size" in str(error.value)
    assert "thresholds must strictly increase" in str(error.value)
