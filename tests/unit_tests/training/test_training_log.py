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
