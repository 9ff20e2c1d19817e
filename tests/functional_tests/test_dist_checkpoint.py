"""pretrain_gpt.py with --ckpt-format torch_dist on CPU ranks (started as torchrun starts them): a checkpoint
saved at TP=2 x PP=2 (4 processes, distributed optimizer with --dist-ckpt-optim-fully-reshardable,
--async-save) resumes at TP=1 x PP=1 (plain optimizer) and TP=4 (distributed optimizer), and the resumed
losses equal the uninterrupted run's (the load of the same kind of checkpoint at PP=4 is
tests/unit_tests/dist_checkpointing/test_resharding.py's).

A 4-layer GPT-2-like model (tied embeddings: the last stage's output copy is not stored), dropout 0,
`--use-cpu-initialization`; a vocabulary of 500 pads to 512 at TP 1, 2 and 4. Tolerance as in the
tensor-parallel test: the TensorBoard `lm loss` of iterations 3 and 4 within 2e-5 relative (another TP/PP
split changes the order of sums; measured ~1e-7).
"""

import json
import os

import pytest

from .harness import read_scalars
from .test_tensor_parallel_training import NO_DROPOUT, TINY, TOLERANCE, pretrain_gpt

COMMON = TINY + NO_DROPOUT + ["--num-layers", "4", "--train-iters", "4", "--save-interval", "2",
                              "--ckpt-format", "torch_dist"]
RESUMED = {
    "TP=1 x PP=1": (1, []),
    "TP=4, distributed optimizer": (4, ["--tensor-model-parallel-size", "4", "--use-distributed-optimizer"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch_dist")
    pretrain_gpt(4, COMMON + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable", "--async-save",
                              "--save", str(work / "straight"),
                              "--tensorboard-dir", str(work / "straight_tb")])
    losses = {"straight": read_scalars(str(work / "straight_tb"), "lm loss")}
    for name, (processes, flags) in RESUMED.items():
        tensorboard = str(work / f"{name}_tb")
        pretrain_gpt(processes, COMMON + flags + ["--load", str(work / "straight"), "--ckpt-step", "2",
                                                  "--tensorboard-dir", tensorboard])
        losses[name] = read_scalars(tensorboard, "lm loss")
    return work, losses


def test_tp2_pp2_save_is_a_sharded_directory_made_latest_after_the_background_write(runs):
    work, _ = runs
    assert (work / "straight" / "latest_checkpointed_iteration.txt").read_text() == "4"
    for iteration in ("iter_0000002", "iter_0000004"):
        directory = work / "straight" / iteration
        assert sorted(os.listdir(directory)) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "metadata.json"]
        assert json.loads((directory / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


@pytest.mark.parametrize("layout", list(RESUMED))
def test_resumed_under_another_layout_continues_the_loss_curve(runs, layout):
    _, losses = runs
    straight, resumed = losses["straight"], losses[layout]
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(straight[iteration], rel=TOLERANCE), (layout, iteration)
