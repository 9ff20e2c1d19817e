"""pretrain_gpt.py on CPU ranks (gloo, started as torchrun starts them) with tensor and sequence parallelism,
against TP=1.

Mock data, 2 layers, hidden 64, sequence 64, dropout 0 and `--use-cpu-initialization` (the same initial
weights at every TP size; a vocabulary of 500 pads to 512 at TP 1, 2 and 4). A GPT-2-like model
(LayerNorm, biases, tied embeddings, learned positions) at TP=2 with sequence parallelism x DP=2 (4
processes), and a Llama-like one (GQA with 2 key/value groups, SwiGLU, RoPE, RMSNorm, untied embeddings,
no biases) at TP=4 with sequence parallelism and --tp-comm-overlap (its chunked, CPU implementation), each
against its TP=1 run; then save/resume and a TP mismatch at TP=2 +SP. Each
process pays seconds of start-up on a 2-core CI machine, hence one 4-process run covers TP x SP x DP.

Tolerance: the TensorBoard `lm loss` and `grad-norm` of every iteration equal TP=1's within 2e-5
relative (fp32; measured ~1e-7). Resuming a TP=2 run (dropout on, so the per-rank RNG streams matter)
reproduces the uninterrupted run bitwise.
"""

import os
import subprocess
import sys

import pytest
import torch

from .harness import ROOT, Job, read_scalars

ITERATIONS = 5
TOLERANCE = 2e-5

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500",
    "--use-cpu-initialization", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA = [
    "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "128",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
    "--disable-bias-linear",
]


def pretrain_gpt(processes: int, args: list[str], expect_failure: bool = False) -> subprocess.CompletedProcess:
    """`python pretrain_gpt.py <args>` on the CPU; N > 1 processes are started as torchrun starts its ranks
    (harness.Job: the environment torchrun sets, without the launcher's own seconds of start-up), their
    output together in `stdout`."""
    if processes > 1:
        codes, output = Job("pretrain_gpt.py", args, processes=processes).wait(timeout_s=600)
        result = subprocess.CompletedProcess(["pretrain_gpt.py", *args], next((c for c in codes if c), 0), output, "")
    else:
        command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args]
        environment = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=environment)
    if (result.returncode != 0) != expect_failure:
        raise AssertionError(f"{processes} process(es) of pretrain_gpt.py {' '.join(args)} exited with "
                             f"{result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _train(tmp_path_factory, name: str, processes: int, args: list[str]) -> dict:
    """{tag: {iteration: value}} of `lm loss` and `grad-norm` of one run."""
    tensorboard = str(tmp_path_factory.mktemp(name) / "tb")
    pretrain_gpt(processes, TINY + NO_DROPOUT + args + ["--train-iters", str(ITERATIONS), "--tensorboard-dir", tensorboard])
    return {tag: read_scalars(tensorboard, tag) for tag in ("lm loss", "grad-norm")}


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    return {
        "TP=1": _train(tmp_path_factory, "gpt_tp1", 1, []),
        "TP=2 +SP x DP=2": _train(tmp_path_factory, "gpt_tp2_sp_dp2", 4, ["--tensor-model-parallel-size", "2",
                                                                          "--sequence-parallel"]),
    }


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    return {
        "TP=1": _train(tmp_path_factory, "llama_tp1", 1, LLAMA),
        "TP=4 +SP +overlap": _train(tmp_path_factory, "llama_tp4", 4, LLAMA + [
            "--tensor-model-parallel-size", "4", "--sequence-parallel", "--tp-comm-overlap"]),
    }


def _assert_same_curves(runs: dict) -> None:
    reference = runs["TP=1"]
    assert sorted(reference["lm loss"]) == list(range(1, ITERATIONS + 1))
    for layout, run in runs.items():
        for tag, values in reference.items():
            assert sorted(run[tag]) == sorted(values), (layout, tag)
            for iteration, value in values.items():
                assert run[tag][iteration] == pytest.approx(value, rel=TOLERANCE), (layout, tag, iteration)


def test_gpt2_like_model_at_tp2_with_sp_times_dp2_matches_tp1(gpt_runs):
    _assert_same_curves(gpt_runs)


def test_llama_like_model_at_tp4_with_overlap_and_fewer_kv_groups_than_ranks_matches_tp1(llama_runs):
    _assert_same_curves(llama_runs)


def _checkpoint(save_dir, iteration: int, tensor_rank: int) -> dict:
    path = os.path.join(save_dir, f"iter_{iteration:07d}", f"mp_rank_{tensor_rank:02d}", "model_optim_rng.pt")
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def tp2_checkpoints(tmp_path_factory):
    """A TP=2 +SP run with dropout and the distributed optimizer saving at iterations 2 and 4, and a second run
    resumed from iteration 2."""
    work = tmp_path_factory.mktemp("tp2_resume")
    common = TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1", "--train-iters", "4", "--save-interval", "2",
                     "--use-distributed-optimizer", "--ckpt-format", "torch"]
    pretrain_gpt(2, common + ["--save", str(work / "straight"), "--tensorboard-dir", str(work / "straight_tb")])
    pretrain_gpt(2, common + ["--load", str(work / "straight"), "--ckpt-step", "2", "--save", str(work / "resumed"),
                         "--tensorboard-dir", str(work / "resumed_tb")])
    return work


def test_tp2_checkpoint_has_one_file_per_tensor_rank(tp2_checkpoints):
    iteration_dir = tp2_checkpoints / "straight" / "iter_0000004"
    assert sorted(os.listdir(iteration_dir)) == ["mp_rank_00", "mp_rank_01"]
    for rank in ("mp_rank_00", "mp_rank_01"):  # the distributed optimizer's state beside each model file
        assert sorted(os.listdir(iteration_dir / rank)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    shards = [_checkpoint(tp2_checkpoints / "straight", 4, rank)["model"] for rank in range(2)]
    # Each rank holds half of the 512 padded vocabulary rows; the norms are whole copies.
    assert [shard["embedding.word_embeddings.weight"].shape[0] for shard in shards] == [256, 256]
    assert torch.equal(shards[0]["decoder.final_layernorm.weight"], shards[1]["decoder.final_layernorm.weight"])


def test_tp2_resume_continues_exactly(tp2_checkpoints):
    straight = read_scalars(str(tp2_checkpoints / "straight_tb"), "lm loss")
    resumed = read_scalars(str(tp2_checkpoints / "resumed_tb"), "lm loss")
    assert sorted(resumed) == [3, 4]
    assert [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)]
    for rank in range(2):
        expected = _checkpoint(tp2_checkpoints / "straight", 4, rank)["model"]
        actual = _checkpoint(tp2_checkpoints / "resumed", 4, rank)["model"]
        assert expected.keys() == actual.keys()
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert torch.equal(value, actual[key]), (rank, key)


def test_loading_a_tp2_checkpoint_at_tp1_names_the_mismatch(tp2_checkpoints):
    result = pretrain_gpt(1, TINY + ["--train-iters", "4", "--load", str(tp2_checkpoints / "straight")],
                      expect_failure=True)
    assert "tensor_model_parallel_size: checkpoint 2, this run 1" in result.stdout + result.stderr
    assert (f"reshard it with: python tools/checkpoint/convert.py --model-type GPT --loader core --saver core "
            f"--load-dir {tp2_checkpoints / 'straight'} --save-dir {tp2_checkpoints / 'straight'}-tp1 "
            "--target-tensor-parallel-size 1") in result.stdout + result.stderr
