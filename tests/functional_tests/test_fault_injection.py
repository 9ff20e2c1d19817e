"""Faults during a 2-rank CPU job (gloo); after each, the job resumes from a complete checkpoint.

One job is taken through every fault in turn, each relaunch with the same command line (`--auto-resume`).
The ranks are started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment);
launch 4 runs under torchrun itself, whose process alone receives the signal:

    launch 1  rank 1 is killed (SIGKILL) in the middle of iteration 3        -> resumes from iteration 2
    launch 2  rank 1's gradients turn NaN in iteration 4 (--bad-step-policy stop): reported with the rank,
              the state after iteration 3 is saved, exit code 17            -> resumes from iteration 3
    launch 3  rank 0 is killed half-way through writing the checkpoint of iteration 4
                                                                             -> resumes from iteration 3
    launch 4  SIGTERM to the launcher only; the ranks save and exit 0        -> resumes from there
    launch 5  the disk fills up while the next checkpoint is written          -> resumes from launch 4's
    launch 6  runs to the end

The loss of every iteration (TensorBoard `lm loss`, later launches overwriting the iterations they redo)
must equal an uninterrupted run's exactly: same data order, weights, optimizer state and RNG streams.
"""

import os
import signal

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from .harness import Job, read_scalars

TRAIN_ITERS = 10
MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0",
    "--seed", "1234", "--split", "100,0,0", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
]


def _write_dataset(prefix: str) -> str:
    """200 documents of random token ids below the vocabulary size, each ending with EOD (127)."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(200):
        document = np.append(rng.integers(0, 127, int(rng.integers(5, 40))), 127)
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def _latest(save_dir) -> int:
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as stream:
        return int(stream.read())


def _resumed_from(output: str) -> int | None:
    marker = "successfully loaded checkpoint from "
    line = next((line for line in output.splitlines() if marker in line), None)
    return None if line is None else int(line.rsplit("at iteration", 1)[1])


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    data = _write_dataset(str(tmp_path_factory.mktemp("data") / "tokens"))
    return MODEL + ["--data-path", data]


def test_job_survives_every_fault_with_the_uninterrupted_loss_trajectory(tmp_path, flags):
    codes, output = Job("pretrain_gpt.py", flags + ["--tensorboard-dir", str(tmp_path / "straight")]).wait()
    assert codes == [0, 0], output[-3000:]
    expected = read_scalars(str(tmp_path / "straight"), "lm loss")
    assert sorted(expected) == list(range(1, TRAIN_ITERS + 1))

    save = str(tmp_path / "ckpt")
    job = flags + ["--save", save, "--save-interval", "2", "--ckpt-format", "torch", "--auto-resume",
                   "--exit-signal-handler",
                   "--tensorboard-dir", str(tmp_path / "faulty")]
    entry = "tests/functional_tests/fault_injection_entry.py"

    codes, output = Job(entry, job, {"FAULT": "kill_mid_iteration:1:3"}).wait()
    assert codes[1] == -signal.SIGKILL and codes[0] != 0 and _latest(save) == 2, output[-3000:]

    codes, output = Job(entry, job, {"FAULT": "nan_grad:1:4"}).wait()
    assert _resumed_from(output) == 2 and codes == [17, 17], output[-3000:]
    assert "iteration 4: non-finite gradients on rank(s) [1] before the data-parallel reduction" in output
    assert _latest(save) == 3

    codes, output = Job(entry, job, {"FAULT": "kill_mid_save:0:4"}).wait()
    assert codes[0] == -signal.SIGKILL and codes[1] != 0, output[-3000:]
    assert _resumed_from(output) == 3 and _latest(save) == 3, output[-3000:]
    assert not os.path.exists(os.path.join(save, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"))

    launcher = Job("pretrain_gpt.py", job, launcher=True)
    lines = []
    for line in launcher.processes[0].stdout:
        lines.append(line)
        if "iteration        5/" in line:
            launcher.processes[0].send_signal(signal.SIGTERM)  # the launcher alone passes it on to the ranks
            break
    _, output = launcher.wait("".join(lines))
    assert _resumed_from(output) == 3, output[-3000:]
    assert output.count("exiting program after receiving signal") == 1, output[-3000:]
    assert "exitcode" not in output, output[-3000:]  # torchrun lists the ranks that exited with an error
    signalled_at = _latest(save)
    assert 5 <= signalled_at < TRAIN_ITERS, output[-3000:]

    next_save = (signalled_at // 2 + 1) * 2
    codes, output = Job(entry, job, {"FAULT": f"disk_full:0:{next_save}"}).wait()
    assert codes[0] == 1 and codes[1] != 0 and _resumed_from(output) == signalled_at, output[-3000:]
    assert "No space left on device" in output and "is intact" in output
    assert _latest(save) == signalled_at

    codes, output = Job("pretrain_gpt.py", job).wait()
    assert codes == [0, 0] and _resumed_from(output) == signalled_at, output[-3000:]
    assert _latest(save) == TRAIN_ITERS

    resumed = read_scalars(str(tmp_path / "faulty"), "lm loss")
    assert [resumed[step] for step in expected] == [expected[step] for step in expected]
