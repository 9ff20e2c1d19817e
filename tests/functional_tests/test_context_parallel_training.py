"""pretrain_gpt.py on CPU ranks (gloo, started as torchrun starts them) with context parallelism, against CP=1.

The command lines of test_tensor_parallel_training.py (mock data, 2 layers, hidden 64, sequence 64, dropout
0, `--use-cpu-initialization`): a Llama-like model (RoPE, GQA, SwiGLU, RMSNorm) at CP=2 x TP=2 with
sequence parallelism and ring attention (4 processes) against its CP=1 run. (The all-gather variant, DP x CP
and the distributed optimizer are covered by tests/unit_tests/transformer/context_parallel.)

Tolerance: the TensorBoard `lm loss` and `grad-norm` of every iteration equal CP=1's within 2e-5 relative
(fp32; measured ~1e-7).
"""

import pytest

from .test_tensor_parallel_training import ITERATIONS, LLAMA, TOLERANCE, _train

CP2_TP2_SP = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--cp-comm-type", "p2p"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _train(tmp_path_factory, "llama_cp1", 1, LLAMA), _train(tmp_path_factory, "llama_cp2", 4, LLAMA + CP2_TP2_SP)


def test_context_parallel_run_matches_cp1(runs):
    reference, context_parallel = runs
    for tag in ("lm loss", "grad-norm"):
        assert sorted(context_parallel[tag]) == sorted(reference[tag]) == list(range(1, ITERATIONS + 1))
        for iteration, expected in reference[tag].items():
            relative = abs(context_parallel[tag][iteration] - expected) / abs(expected)
            assert relative < TOLERANCE, f"{tag} at iteration {iteration}: {relative}"
