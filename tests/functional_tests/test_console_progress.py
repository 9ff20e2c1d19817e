"""The console line in a terminal: a progress bar, and the time remaining = iterations left x the interval's
time per iteration (pretrain_gpt.py on a pseudo-terminal; piped, as in every other test, there is no bar)."""

import os
import pty
import re
import subprocess
import sys

from .harness import ROOT

TRAIN_ITERS = 100000  # stopped by --exit-interval 3: the time remaining is then tens of minutes
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--train-iters", str(TRAIN_ITERS), "--exit-interval", "3", "--log-interval", "1", "--eval-iters", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0",
]


def _run_on_a_terminal() -> str:
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS], cwd=ROOT,
                               stdout=follower, stderr=follower,
                               env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert process.wait(timeout=120) == 0
    return b"".join(chunks).decode(errors="replace")


def test_terminal_shows_a_progress_bar_and_the_time_remaining():
    output = _run_on_a_terminal()
    line = next(line for line in output.splitlines() if f"iteration        3/  {TRAIN_ITERS}" in line)
    assert "| [--------------------]   0% |" in line, line
    milliseconds = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1))
    hours, minutes, seconds = map(int, re.search(r"time remaining: (\d+):(\d\d):(\d\d)", line).groups())
    expected = (TRAIN_ITERS - 3) * milliseconds / 1000
    # The console rounds the time per iteration to 0.1 ms (at most 5 s over 99,997 iterations).
    assert abs(hours * 3600 + minutes * 60 + seconds - expected) <= 6, (line, expected)
