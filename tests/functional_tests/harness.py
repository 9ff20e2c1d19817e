"""Run the real command lines (preprocess -> pretrain_gpt.py -> resume) and read their TensorBoard events.

Each run is a subprocess, as a user would start it. Losses are read from the TensorBoard event files
with the tags Megatron writes (`lm loss`), as Megatron's functional tests do.
"""

import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "4", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "10", "--num-workers", "0", "--eval-interval", "1000", "--eval-iters", "1",
]


def run(script: str, args: list[str], timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python <script> <args>` from the repository root; fails the test with its output if it fails."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment,
    )
    if result.returncode != 0:
        raise AssertionError(f"{script} exited with {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def run_until_signalled(script: str, args: list[str], iteration: int, signal_number: int) -> tuple[int, str]:
    """Runs `python <script> <args>` and sends it `signal_number` once the console line of `iteration` is out;
    returns (its exit code, its output)."""
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    lines = []
    for line in process.stdout:
        lines.append(line)
        if f"iteration {iteration:8d}/" in line:
            process.send_signal(signal_number)
            break
    lines.extend(process.stdout)
    return process.wait(timeout=120), "".join(lines)


def read_scalars(logdir: str, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard scalar tag over every event file in `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for name in sorted(os.listdir(logdir)):
        accumulator = EventAccumulator(os.path.join(logdir, name), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({event.step: event.value for event in accumulator.Scalars(tag)})
    return values
