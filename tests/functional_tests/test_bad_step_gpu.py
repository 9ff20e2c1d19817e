"""Bad steps on a GPU, where the fused AdamW skips a flagged update on the device and the host settles the
verdict one step later (megatron/training/bad_step.py): the run must behave as if it had checked at once.

One process, bf16, mock data; the fault-injection entry turns the gradients of iteration 4 into NaN.
- stop: exit 17 naming iteration 4, the checkpoint of iteration 3 saved (and no later one);
- skip: the run goes on to the end, and the log line of the interval with iteration 4 counts one skipped and
  one nan iteration (counted on the device, read when the line is printed).
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from .harness import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-layers", "2",
         "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "4",
         "--lr", "1e-3", "--train-iters", "8", "--log-interval", "4", "--eval-iters", "0", "--bf16",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]
_LOSS = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.E+-]+).*?number of skipped iterations: +(\d+) \| "
                   r"number of nan iterations: +(\d+)")


def _run(extra, fault=None):
    environment = dict(os.environ, FAULT=fault) if fault else dict(os.environ)
    script = "tests/functional_tests/fault_injection_entry.py" if fault else "pretrain_gpt.py"
    return subprocess.run([sys.executable, script, *FLAGS, *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=environment)


def test_a_bad_step_found_one_step_late_stops_or_is_skipped_as_at_once(tmp_path):
    save = str(tmp_path / "ckpt")
    stopped = _run(["--save", save, "--save-interval", "100"], fault="nan_grad:0:4")
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 17, output[-3000:]
    assert "bad step at iteration 4: non-finite gradients on rank(s) [0]" in output, output[-3000:]
    assert "saved the state after iteration 3" in output
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"

    skipped = _run(["--bad-step-policy", "skip", "--bad-step-skip-budget", "1"], fault="nan_grad:0:4")
    output = skipped.stdout + skipped.stderr
    assert skipped.returncode == 0, output[-3000:]
    lines = {int(step): (float(loss), int(skips), int(nans)) for step, loss, skips, nans in _LOSS.findall(output)}
    assert lines[4][1:] == (1, 1) and lines[8][1:] == (0, 0), output[-3000:]
    assert "bad step at iteration 4" in output and "skipping this update" in output
