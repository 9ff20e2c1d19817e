"""pretrain_gpt.py with Megatron's common MoE layout, expert TP below TP: TP=2 with sequence parallelism,
expert TP 1, EP=2 (so DP=2 for dense params, expert-DP 2 for experts) on 4 CPU ranks (started as torchrun starts them),
with the distributed optimizer and torch-format checkpoints, against one process at TP=1, EP=1.

Tiny SwiGLU model, 4 experts top-2 with the all-to-all dispatcher, load-balancing and z losses, no dropout,
`--use-cpu-initialization` (the same weights in every layout). The micro-batch is the balancing domain
of the load-balancing loss in both runs (each DP rank's micro-batch is one of the single process's).

Tolerance (test_expert_parallel.py's for losses): `lm loss`, `grad-norm`, `load_balancing_loss` and
`z_loss` in TensorBoard equal TP=1's within 1e-5 relative at every iteration (fp32; measured <= 8e-7).
A run resumed from the iteration-2 checkpoint continues bit for bit: losses, and every tensor of every
`mp_rank_TT_EEE` file at iteration 4.
"""

import os

import pytest
import torch

from .harness import read_scalars
from .test_tensor_parallel_training import NO_DROPOUT, TINY, pretrain_gpt

ITERATIONS = 4
TOLERANCE = 1e-5
TAGS = ("lm loss", "grad-norm", "load_balancing_loss", "z_loss")
MOE = [
    "--swiglu", "--ffn-hidden-size", "128", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
    "--train-iters", str(ITERATIONS),
] + NO_DROPOUT
EXPERT_LAYOUT = [
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
    "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--ckpt-format", "torch",
    "--save-interval", "2",
]
# (TP rank, EP rank) of ranks 0-3: TP varies fastest, EP over expert TP 1 too.
FILES = ["mp_rank_00_000", "mp_rank_01_001"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("expert_tp")
    pretrain_gpt(1, TINY + MOE + ["--tensorboard-dir", str(work / "reference_tb")])
    pretrain_gpt(4, TINY + MOE + EXPERT_LAYOUT + ["--save", str(work / "straight"),
                                                  "--tensorboard-dir", str(work / "straight_tb")])
    pretrain_gpt(4, TINY + MOE + EXPERT_LAYOUT + ["--load", str(work / "straight"), "--ckpt-step", "2",
                                                  "--save", str(work / "resumed"),
                                                  "--tensorboard-dir", str(work / "resumed_tb")])
    return work


def test_tp2_with_expert_tp1_and_ep2_matches_one_process(runs):
    for tag in TAGS:
        reference = read_scalars(str(runs / "reference_tb"), tag)
        parallel = read_scalars(str(runs / "straight_tb"), tag)
        assert sorted(reference) == sorted(parallel) == list(range(1, ITERATIONS + 1)), tag
        for iteration, value in reference.items():
            assert parallel[iteration] == pytest.approx(value, rel=TOLERANCE), (tag, iteration)


def test_resume_from_torch_checkpoint_with_distributed_optimizer_continues_exactly(runs):
    straight = read_scalars(str(runs / "straight_tb"), "lm loss")
    resumed = read_scalars(str(runs / "resumed_tb"), "lm loss")
    assert sorted(resumed) == [3, 4] and [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)]
    for iteration_dir in (runs / "straight" / "iter_0000004", runs / "resumed" / "iter_0000004"):
        assert sorted(os.listdir(iteration_dir)) == FILES
    for name in FILES:
        files = [runs / run / "iter_0000004" / name for run in ("straight", "resumed")]
        assert all(sorted(os.listdir(path)) == ["distrib_optim.pt", "model_optim_rng.pt"] for path in files)
        expected, actual = (torch.load(path / "model_optim_rng.pt", weights_only=False)["model"] for path in files)
        assert expected.keys() == actual.keys()
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert torch.equal(value, actual[key]), (name, key)
