"""`ExitConditions.checkpoint_and_decide_exit`: the deferred console line goes out before the exit is announced."""

import argparse

from megatron.training.exit_conditions import ExitConditions


def test_the_line_is_flushed_before_the_exit_is_announced(capsys):
    args = argparse.Namespace(exit_signal_handler=False, save=None, save_interval=None, exit_duration_in_mins=None,
                              exit_interval=4)
    conditions = ExitConditions(args, device="cpu")
    flush = lambda: print("iteration 4 line")  # noqa: E731
    assert conditions.checkpoint_and_decide_exit(3, save=None, before_exit=flush) is None
    assert capsys.readouterr().out == ""
    assert conditions.checkpoint_and_decide_exit(4, save=None, before_exit=flush) == 0
    assert capsys.readouterr().out.splitlines() == ["iteration 4 line", "exiting program at iteration 4"]
