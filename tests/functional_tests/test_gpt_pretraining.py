"""GPT pretraining end to end on the built-in corpus: preprocess -> pretrain_gpt.py -> resume.

Golden loss values live in `golden/`; regenerate them with `UPDATE_GOLDEN=1 pytest <this file>`. They
depend on the corpus, i.e. on the Python version's standard library (CI: 3.11); the comparison is
approximate (rtol 5%, as Megatron's functional tests) so that CPU kernels of other machines pass.
"""

import json
import math
import os
import re
import signal

import pytest
import torch

from .harness import TINY_GPT, read_scalars, run, run_until_signalled

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "gpt_builtin_corpus.json")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The quick start's data steps on the built-in corpus."""
    work = tmp_path_factory.mktemp("data")
    corpus = str(work / "stdlib.jsonl")
    run("tools/build_stdlib_corpus.py", ["--output", corpus])
    run("tools/train_tokenizer.py", ["--input", corpus, "--type", "gpt2", "--vocab-size", "4000",
                                     "--output-dir", str(work / "tok")])
    vocab, merges = str(work / "tok" / "vocab.json"), str(work / "tok" / "merges.txt")
    run("tools/preprocess_data.py", ["--input", corpus, "--output-prefix", str(work / "stdlib"),
                                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                     "--merge-file", merges, "--append-eod", "--workers", "2"])
    return ["--data-path", str(work / "stdlib_text_document"), "--vocab-file", vocab, "--merge-file", merges,
            "--split", "98,2,0"]


def test_loss_falls_on_builtin_corpus_and_matches_golden(tmp_path, dataset):
    tensorboard = str(tmp_path / "tb")
    run("pretrain_gpt.py", TINY_GPT + dataset + ["--train-iters", "200", "--tensorboard-dir", tensorboard])
    losses = read_scalars(tensorboard, "lm loss")
    assert sorted(losses) == list(range(1, 201))
    assert losses[1] > math.log(4000) - 0.5  # starts near uniform over the vocabulary
    assert losses[200] < losses[1] - 1.5  # and learns the corpus
    measured = {str(step): round(losses[step], 5) for step in [1] + list(range(10, 201, 10))}
    if os.environ.get("UPDATE_GOLDEN"):
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as stream:
            json.dump({"lm loss": {"start_step": 1, "end_step": 200, "step_interval": 10, "values": measured}},
                      stream, indent=2)
    with open(GOLDEN) as stream:
        golden = json.load(stream)["lm loss"]["values"]
    for step, value in golden.items():
        assert measured[step] == pytest.approx(value, rel=0.05), f"lm loss at step {step}"


def _final_weights(save_dir: str, iteration: int) -> dict:
    path = os.path.join(save_dir, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_resume_is_exact(tmp_path, dataset):
    # Dropout on, so the restored RNG state matters as much as weights, optimizer and data position.
    # 8 iterations resumed after 4, the learning rate warming up for 2 and decaying over the rest.
    common = TINY_GPT + dataset + ["--train-iters", "8", "--lr-warmup-iters", "2", "--hidden-dropout", "0.1",
                                   "--attention-dropout", "0.1", "--log-interval", "1", "--ckpt-format", "torch"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run("pretrain_gpt.py", common + ["--save", str(straight / "ckpt"), "--save-interval", "8",
                                     "--tensorboard-dir", str(straight / "tb")])
    run("pretrain_gpt.py", common + ["--save", str(split / "ckpt"), "--save-interval", "4", "--exit-interval", "4",
                                     "--tensorboard-dir", str(split / "tb")])
    assert not os.path.exists(split / "ckpt" / "iter_0000008")
    run("pretrain_gpt.py", common + ["--save", str(split / "ckpt"), "--save-interval", "8",
                                     "--load", str(split / "ckpt"), "--tensorboard-dir", str(split / "tb")])
    expected = read_scalars(str(straight / "tb"), "lm loss")
    resumed = read_scalars(str(split / "tb"), "lm loss")
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[i] for i in range(1, 9)] == [expected[i] for i in range(1, 9)]
    a, b = _final_weights(str(straight / "ckpt"), 8), _final_weights(str(split / "ckpt"), 8)
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key


RAMPUP = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--rampup-batch-size", "2", "2", "20", "--train-samples", "60", "--lr", "1e-3", "--lr-warmup-samples", "8",
    "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--num-workers", "0", "--ckpt-format", "torch",
]
CONSOLE_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*global batch size:\s+(\d+) \| "
                          r"lm loss: (\S+) \|")


def _console(output: str) -> dict:
    """{iteration: (iterations in the run, consumed samples, global batch size, lm loss)} of the console."""
    return {int(match[1]): (int(match[2]), int(match[3]), int(match[4]), match[5])
            for match in CONSOLE_LINE.finditer(output)}


def test_batch_size_rampup_over_train_samples_resumes_mid_ramp(tmp_path):
    # 2 -> 8 by 2 over 20 samples: 3 increments, one every 6.67 samples; the ramp is walked up to the step
    # that crosses 20 samples (consumed 22 after 7 steps), then (60 - 22) // 8 = 4 whole batches: 11 steps.
    straight = _console(run("pretrain_gpt.py", RAMPUP + ["--save", str(tmp_path), "--save-interval", "6"]).stdout)
    assert [straight[i][2] for i in range(1, 12)] == [2, 2, 2, 2, 4, 4, 6, 8, 8, 8, 8]
    assert straight[11][:2] == (11, 54)
    resumed = _console(run("pretrain_gpt.py", RAMPUP + ["--load", str(tmp_path), "--ckpt-step", "6"]).stdout)
    assert resumed == {i: straight[i] for i in range(7, 12)}


def test_codeparrot_tutorial_command_runs(tmp_path, dataset):
    """The CodeParrot tutorial's pretrain_gpt.py command, every flag kept, sizes shrunk for a CPU."""
    data_path, vocab, merges = dataset[1], dataset[3], dataset[5]
    result = run("pretrain_gpt.py", [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4",  # fp16 matmuls are slow on a CPU
        "--lr", "0.00015", "--train-iters", "4", "--lr-decay-iters", "3", "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
        "--fp16", "--data-path", data_path, "--vocab-file", vocab, "--merge-file", merges,
        "--save", str(tmp_path / "checkpoints"), "--save-interval", "2", "--log-interval", "1",
        "--ckpt-format", "torch",
        "--eval-interval", "2", "--eval-iters", "1", "--activations-checkpoint-method", "uniform",
    ])
    assert "iteration        4/       4" in result.stdout
    assert "validation loss at iteration 4" in result.stdout
    assert os.path.exists(tmp_path / "checkpoints" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt")
    with open(tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt") as stream:
        assert stream.read().strip() == "4"


def test_exit_signal_handler_saves_and_exits_cleanly(tmp_path, dataset):
    """SIGTERM with --exit-signal-handler: the run saves a checkpoint at the next iteration and exits 0."""
    code, output = run_until_signalled("pretrain_gpt.py", [
        *TINY_GPT, *dataset, "--train-iters", "100000", "--log-interval", "1", "--exit-signal-handler",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "100000"], 3, signal.SIGTERM)
    assert code == 0, output[-3000:]
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt") as stream:
        iteration = int(stream.read())
    assert 3 <= iteration < 100000
    assert f"exiting program after receiving signal SIGTERM at iteration {iteration}" in output
