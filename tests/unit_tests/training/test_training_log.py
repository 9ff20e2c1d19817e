"""The console line's per-interval counts when each step's verdict is a device flag (bad_step.py)."""

import math

import torch

from megatron.training.training_log import _Interval


def test_device_flagged_iterations_are_counted_when_the_line_is_printed():
    """Four iterations with device flags and one without: the losses average over the updates that were not
    skipped; a skipped iteration counts as nan when its loss or grad norm is not finite. Each iteration keeps
    a copy of its values (a CUDA graph rewrites its loss buffer in place)."""
    interval = _Interval()
    loss = torch.tensor(2.0)
    for value, skipped, grad_norm in ((2.0, 0, 1.0), (float("nan"), 1, float("nan")), (9.0, 1, 3.0),
                                      (4.0, 0, torch.tensor(2.0))):
        loss.fill_(value)
        interval.add({"lm loss": loss}, torch.tensor([skipped], dtype=torch.int32), grad_norm)
    interval.add({"lm loss": torch.tensor(6.0)}, 0, 1.0)  # a verdict read at once
    loss.fill_(100.0)
    interval.settle()
    assert (interval.iterations, int(interval.advanced), int(interval.skipped), int(interval.nan)) == (5, 3, 2, 1)
    assert math.isclose(float(interval.losses["lm loss"]) / int(interval.advanced), 4.0)
    interval.settle()  # nothing left to fold
    assert int(interval.advanced) == 3


def test_a_deferred_line_prints_once_the_next_iteration_is_queued(capsys):
    """With defer_line the line of iteration 2 comes at iteration 3's call, with iterations 1-2's values: not
    iteration 3's loss, not the loss scale the scaler wrote since; flush() prints the last one. The lines
    equal those printed at once. (On a CPU the values are taken at once; on a GPU they are copied behind the
    iteration: tests/unit_tests/training/test_training_log_gpu.py.)"""
    from megatron.core.timers import Timers
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.batch_plan import StepBatch
    from megatron.training.train_state import TrainState
    from megatron.training.training_log import TrainingLogger

    args = validate_args(parse_args(args_list=[
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--log-interval", "2"]))
    args.padded_vocab_size = 1024  # the tokenizer's part, not built here
    printed = {}
    for defer in (False, True):
        timers = Timers(0, "minmax")
        timers("interval-time", log_level=0).start()
        logger, state, scale = TrainingLogger(args, timers, 4, 0, defer_line=defer), TrainState(), torch.tensor(1.0)
        lines = []
        for iteration in range(1, 5):
            state.iteration, state.consumed_train_samples = iteration, 2 * iteration
            logger.log(state, StepBatch(2, 2, 1), {"lm loss": torch.tensor(float(iteration))}, 1e-3, scale, 0,
                       torch.tensor(0.5), None)
            scale.fill_(2.0 ** iteration)
            lines.append(capsys.readouterr().out)
        logger.flush()
        lines.append(capsys.readouterr().out)
        printed[defer] = lines
    at_once, deferred = printed[False], printed[True]
    assert "iteration        2/" in at_once[1] and "iteration        4/" in at_once[3] and at_once[4] == ""
    assert deferred[1] == "" and "iteration        2/" in deferred[2]
    assert deferred[3] == "" and "iteration        4/" in deferred[4]
    for now, later in ((at_once[1], deferred[2]), (at_once[3], deferred[4])):
        fields = lambda line: [field for field in line.split(" | ")[1:] if "ms" not in field and "/s" not in field
                               and "time remaining" not in field]
        assert fields(now) == fields(later)
    assert "lm loss: 1.500000E+00" in deferred[2] and "loss scale: 2.0" in deferred[2]
