"""pretrain_bert.py and pretrain_t5.py get what pretrain_gpt.py gets from pretrain(): the start-up banner (the
built model's parameters; a T5's estimate from its arguments equals them), --dry-run, --exit-signal SIGUSR1
saving at the end of the iteration and exiting 0, --auto-resume, and the bad-step policy (a NaN gradient
stops with exit code 17 naming the rank and iteration; skip goes on and counts it).

The data is written here: a WordPiece vocab.txt of 200 entries and 300 sentence-split documents of random ids.
"""

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from .harness import ROOT, run, run_until_signalled

COMMON = [
    "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings", "64", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--num-workers", "0", "--split", "100,0,0", "--seed", "1234",
]
BERT = COMMON + ["--num-layers", "2", "--seq-length", "64"]
T5 = COMMON + ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--encoder-seq-length", "64",
               "--decoder-seq-length", "32", "--vocab-extra-ids", "10"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """--data-path and --vocab-file of sentence-split documents (2 to 5 sentences of 4 to 19 word ids)."""
    directory = tmp_path_factory.mktemp("sentences")
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(195)]) + "\n")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(directory / "data_text_sentence.bin"), dtype=np.int32)
    for _ in range(300):
        sentences = [rng.integers(5, 200, int(rng.integers(4, 20))) for _ in range(int(rng.integers(2, 6)))]
        builder.add_document(np.concatenate(sentences), [len(sentence) for sentence in sentences])
    builder.finalize(str(directory / "data_text_sentence.idx"))
    return ["--data-path", str(directory / "data_text_sentence"), "--vocab-file", str(vocab)]


def _number(pattern: str, output: str) -> int:
    match = re.search(pattern, output)
    assert match, (pattern, output[-3000:])
    return int(match.group(1).replace(",", ""))


def _built_parameters(output: str) -> int:
    """The parameters of the one rank's built model, as get_model() prints them."""
    return _number(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, 0\): (\d+)", output)


def _latest(save_dir) -> int:
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as stream:
        return int(stream.read())


def _t5_with_a_nan_gradient_in_iteration_3(flags: list) -> subprocess.CompletedProcess:
    """pretrain_t5.py whose gradients turn NaN in iteration 3 (fault_injection_entry.py)."""
    entry = os.path.join(ROOT, "tests", "functional_tests", "fault_injection_entry.py")
    environment = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", FAULT="nan_grad:0:3",
                       FAULT_SCRIPT="pretrain_t5.py")
    return subprocess.run([sys.executable, entry, *flags], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=environment)


def test_bert_saves_on_sigusr1_and_auto_resumes(tmp_path, data):
    save = str(tmp_path / "ckpt")
    flags = BERT + data + ["--train-iters", "1000", "--save", save, "--save-interval", "1000", "--auto-resume",
                           "--exit-signal-handler", "--exit-signal", "SIGUSR1"]
    code, output = run_until_signalled("pretrain_bert.py", flags, 3, signal.SIGUSR1)
    assert code == 0, output[-3000:]
    assert _number(r"model: ([\d,]+) parameters", output) == _built_parameters(output)
    assert "signals: SIGUSR1 saves a checkpoint at the end of the iteration and exits 0" in output
    signalled_at = _latest(save)
    assert 3 <= signalled_at < 1000
    assert f"exiting program after receiving signal SIGUSR1 at iteration {signalled_at}" in output

    resumed = run("pretrain_bert.py", flags + ["--exit-interval", str(signalled_at + 2)])
    assert re.search(rf"successfully loaded checkpoint from {re.escape(save)} .* at iteration {signalled_at}\n",
                     resumed.stdout)
    assert f"iteration {signalled_at + 2:8d}/    1000" in resumed.stdout and _latest(save) == signalled_at + 2


def test_t5_dry_run_banner_and_bad_step_policies(tmp_path, data):
    dry = run("pretrain_t5.py", T5 + data + ["--train-iters", "6", "--dry-run"], env={"WORLD_SIZE": "2"})
    assert "dry run: the arguments are valid for world size 2" in dry.stdout
    estimated = _number(r"parameters: ([\d,]+) in total", dry.stdout)

    save = str(tmp_path / "ckpt")
    stop = _t5_with_a_nan_gradient_in_iteration_3(T5 + data + ["--train-iters", "6", "--save", save,
                                                               "--save-interval", "100"])
    output = stop.stdout + stop.stderr
    assert stop.returncode == 17, output[-3000:]
    assert estimated == _built_parameters(output) == _number(r"model: ([\d,]+) parameters", output)
    assert "iteration 3: non-finite gradients on rank(s) [0] (the global gradient norm)" in output
    assert _latest(save) == 2  # the state before the bad step

    skip = _t5_with_a_nan_gradient_in_iteration_3(T5 + data + ["--train-iters", "4", "--bad-step-policy", "skip"])
    assert skip.returncode == 0, (skip.stdout + skip.stderr)[-3000:]
    third = next(line for line in skip.stdout.splitlines() if "iteration        3/" in line)
    assert "number of skipped iterations:   1" in third and "number of nan iterations:   1" in third
    assert "iteration        4/" in skip.stdout
