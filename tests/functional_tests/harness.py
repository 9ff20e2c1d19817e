"""Run the real command lines (preprocess -> pretrain_gpt.py -> resume) and read their TensorBoard events.

Each run is a subprocess, as a user would start it. Losses are read from the TensorBoard event files
with the tags Megatron writes (`lm loss`), as Megatron's functional tests do.
"""

import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "4", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "10", "--num-workers", "0", "--eval-interval", "1000", "--eval-iters", "1",
]


JOB_TIMEOUT_S, SURVIVOR_GRACE_S = 180, 60


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


def free_port() -> str:
    """A TCP port free on the loopback interface now, for a job's MASTER_PORT."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


class Job:
    """`processes` ranks of `python <script> <flags>` started as torchrun starts them (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) without the launcher process,
    which costs each launch a Python and torch start-up of its own (~3 s on a 2-core machine); `launcher=True`
    runs them under torchrun instead. `env` is added to every rank's environment."""

    def __init__(self, script: str, flags: list, env: dict | None = None, launcher: bool = False,
                 processes: int = 2):
        path = os.path.join(ROOT, script)
        port = free_port()
        environment = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {}))
        if launcher:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                       "--master-port", port, path, *flags]
            self.processes = [subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)]
            return
        self.processes = []
        for rank in range(processes):
            rank_environment = dict(environment, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                                    LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            self.processes.append(subprocess.Popen([sys.executable, path, *flags], cwd=ROOT, env=rank_environment,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def wait(self, already_read: str = "", timeout_s: float = JOB_TIMEOUT_S,
             survivor_grace_s: float = SURVIVOR_GRACE_S) -> tuple[list, str]:
        """(exit code of each process, their output). Once a rank has failed, the others get survivor_grace_s
        to end on their own and are then killed, as torchrun's agent stops the rest of a job whose worker
        failed: gloo usually reports a dead peer at once, but a survivor was once seen hanging instead (in
        a full-suite run on 2 cores), and in a real job the launcher, not the survivor, ends it."""
        outputs = [[] for _ in self.processes]
        readers = [threading.Thread(target=lambda process=process, output=output: output.append(process.stdout.read()))
                   for process, output in zip(self.processes, outputs)]
        for reader in readers:
            reader.start()
        started, failed_at, timed_out = time.monotonic(), None, False
        while any(process.poll() is None for process in self.processes):
            now = time.monotonic()
            if failed_at is None and any(process.returncode not in (None, 0) for process in self.processes):
                failed_at = now
            timed_out = now - started > timeout_s
            if timed_out or (failed_at is not None and now - failed_at > survivor_grace_s):
                for process in self.processes:
                    if process.poll() is None:
                        process.kill()
            time.sleep(0.2)
        for reader in readers:
            reader.join()
        output = already_read + "".join(text for text, in outputs)
        assert not timed_out, f"ran past {timeout_s} s: {output[-3000:]}"
        return [process.returncode for process in self.processes], output


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
