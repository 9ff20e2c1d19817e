"""tools/bench/fsdp.py's speed table from the console lines of its runs (the runs replaced by made-up output with
known answers): with --rounds the ratios are per round, against that round's reference run."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
import fsdp  # noqa: E402


def test_ratios_are_taken_per_round_against_that_rounds_reference(monkeypatch):
    speeds = iter([100.0, 90.0, 200.0, 170.0])  # round 1: reference, ZeRO-3; round 2: the machine got faster

    def console(gpus, args, **unused):
        tokens = next(speeds)
        lines = [f"iteration {i} | tokens/s/GPU: {tokens} | lm loss: {4.0 + i / 100:.4E} |" for i in range(1, 6)]
        return "\n".join(lines + ["memory | max allocated: 2048.0 |"])

    monkeypatch.setattr(fsdp, "train", console)
    header, reference, zero3 = fsdp.speed([0, 4], profile_dir=None, rounds=2)
    assert "per round" in header
    assert reference.split()[-6:] == ["150", "1.000", "1.00", "1.00", "2.0", "0.0e+00"]
    assert zero3.split()[-6:] == ["130", "0.875", "0.90", "0.85", "2.0", "0.0e+00"]  # not 130 / 150 = 0.867
