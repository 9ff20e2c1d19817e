"""Timers: levels, accumulation, Megatron's report formats, TensorBoard tags, min/max over ranks."""

import time

import pytest

from megatron.core.timers import DummyTimer, Timer, Timers, timed
from tests.unit_tests.dist_utils import run_distributed


class RecordingWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_levels_above_the_configured_one_are_dummies():
    timers = Timers(log_level=1, log_option="minmax")
    assert isinstance(timers("batch-generator", log_level=2), DummyTimer)
    assert isinstance(timers("forward-backward", log_level=1), Timer)
    timers("batch-generator", log_level=2).start()
    timers("batch-generator", log_level=2).stop()
    with pytest.raises(RuntimeError, match="--timing-log-level"):
        timers("batch-generator", log_level=2).elapsed()


def test_elapsed_accumulates_until_reset():
    timer = Timers(2, "minmax")("step", log_level=0)
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        timer.stop()
    kept = timer.elapsed(reset=False)
    assert 0.04 <= kept < 1.0
    assert timer.elapsed(reset=True) >= kept
    assert timer.elapsed() == 0.0
    assert timer.active_time() >= 0.04


def test_misuse_is_reported():
    timers = Timers(2, "minmax")
    timer = timers("optimizer", log_level=1)
    timer.start()
    with pytest.raises(RuntimeError, match="already been started"):
        timer.start()
    with pytest.raises(ValueError, match="log level 1"):
        timers("optimizer", log_level=2)
    with pytest.raises(ValueError, match="minmax"):
        Timers(1, "median")


def test_minmax_report_format(capsys):
    timers = Timers(1, "minmax")
    with timed(timers, "forward-backward"):
        time.sleep(0.01)
    timers.log(["forward-backward"], normalizer=2.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "(min, max) time across ranks (ms):"
    prefix = "    forward-backward " + "." * (48 - len("forward-backward ")) + ": ("
    assert lines[1].startswith(prefix)
    low, high = (float(value) for value in lines[1][len(prefix):-1].split(", "))
    assert low == high and 5.0 <= low < 500.0  # 10 ms over a normalizer of 2


def test_max_and_all_report_formats():
    for option, header in [("max", "max time across ranks (ms):"), ("all", "times across ranks (ms):")]:
        timers = Timers(1, option)
        with timed(timers, "optimizer"):
            time.sleep(0.005)
        report = timers.get_all_timers_string(["optimizer"])
        assert report.splitlines()[0] == header
        assert "optimizer" in report
    assert Timers(1, "minmax").get_all_timers_string(["never-started"]) is None


def test_write_sends_max_seconds_per_iteration():
    timers = Timers(1, "minmax")
    with timed(timers, "interval-time", log_level=0):
        time.sleep(0.01)
    writer = RecordingWriter()
    timers.write(["interval-time"], writer, iteration=7, normalizer=2.0)
    [(tag, value, step)] = writer.scalars
    assert tag == "interval-time-time" and step == 7
    assert 0.005 <= value < 0.5


def _time_on_two_ranks(rank, world_size):
    timers = Timers(1, "minmax")
    with timed(timers, "forward-backward"):
        time.sleep(0.02 if rank == 0 else 0.2)
    return timers.get_all_timers_string(["forward-backward"])


def test_min_and_max_are_taken_over_ranks():
    reports = run_distributed(_time_on_two_ranks, 2)
    assert reports[0] == reports[1]
    low, high = (float(value) for value in reports[0].splitlines()[1].split(": (")[1][:-1].split(", "))
    assert 20.0 <= low < 200.0 <= high
