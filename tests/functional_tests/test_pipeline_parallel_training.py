"""pretrain_gpt.py on CPU ranks (gloo, started as torchrun starts them) with pipeline parallelism:
checkpoints and exact resume.

A 4-layer GPT (tied embeddings, dropout on) on 2 pipeline stages, once with the 1F1B schedule and the
distributed optimizer, once interleaved with 2 virtual stages of 1 layer per rank. Each run saves at
iterations 2 and 4 and evaluates; a second run resumes from iteration 2. Checked against Megatron's layout
(reference 8.1, 8.2, 12 item 13): one `mp_rank_00_00P` directory per stage, local layer numbers in each
stage's state dict, the tied output weight on the last stage equal to the first stage's embedding, and
`model0` / `model1` per virtual stage; the resumed run reproduces iterations 3 and 4 bitwise (losses and
every saved tensor). Training equivalence with one process is checked by the unit tests
(tests/unit_tests/pipeline_parallel/test_pipeline_training.py).
"""

import os

import pytest
import torch

from .harness import read_scalars
from .test_tensor_parallel_training import TINY, pretrain_gpt

PIPELINE = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--train-iters", "4", "--save-interval", "2", "--eval-interval", "2",
            "--eval-iters", "1", "--ckpt-format", "torch"]
LAYOUTS = {
    "1F1B": ["--use-distributed-optimizer"],
    "interleaved": ["--num-layers-per-virtual-pipeline-stage", "1"],
}


def _checkpoint(save_dir, iteration: int, pipeline_rank: int) -> dict:
    path = os.path.join(save_dir, f"iter_{iteration:07d}", f"mp_rank_00_{pipeline_rank:03d}", "model_optim_rng.pt")
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pipeline_checkpoints(request, tmp_path_factory):
    """(layout, work dir) of a straight run and a run resumed from its iteration-2 checkpoint."""
    work = tmp_path_factory.mktemp(f"pp2_{request.param}")
    common = TINY + PIPELINE + LAYOUTS[request.param]
    pretrain_gpt(2, common + ["--save", str(work / "straight"), "--tensorboard-dir", str(work / "straight_tb")])
    pretrain_gpt(2, common + ["--load", str(work / "straight"), "--ckpt-step", "2", "--save", str(work / "resumed"),
                              "--tensorboard-dir", str(work / "resumed_tb")])
    return request.param, work


def test_checkpoint_layout_per_stage(pipeline_checkpoints):
    layout, work = pipeline_checkpoints
    iteration_dir = work / "straight" / "iter_0000004"
    assert sorted(os.listdir(iteration_dir)) == ["mp_rank_00_000", "mp_rank_00_001"]
    first, last = (_checkpoint(work / "straight", 4, rank) for rank in range(2))
    if layout == "1F1B":
        first_models, last_models = [first["model"]], [last["model"]]
        assert sorted(os.listdir(iteration_dir / "mp_rank_00_001")) == ["distrib_optim.pt", "model_optim_rng.pt"]
    else:
        assert "model" not in first and "model2" not in first
        first_models, last_models = [first["model0"], first["model1"]], [last["model0"], last["model1"]]
    layers = {
        key.split(".")[2] for model in first_models + last_models for key in model if key.startswith("decoder.layers.")
    }
    assert layers == ({"0", "1"} if layout == "1F1B" else {"0"})  # local numbering on every stage / chunk
    assert "embedding.word_embeddings.weight" in first_models[0] and "output_layer.weight" not in first_models[0]
    assert "decoder.final_layernorm.weight" in last_models[-1]
    # The last stage's copy of the tied embedding took the same updates as the first stage's.
    assert torch.equal(last_models[-1]["output_layer.weight"], first_models[0]["embedding.word_embeddings.weight"])


def test_pipeline_resume_continues_exactly(pipeline_checkpoints):
    _, work = pipeline_checkpoints
    straight = read_scalars(str(work / "straight_tb"), "lm loss")
    resumed = read_scalars(str(work / "resumed_tb"), "lm loss")
    assert sorted(resumed) == [3, 4]
    assert [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)]
    assert read_scalars(str(work / "resumed_tb"), "lm loss validation")[4] == read_scalars(
        str(work / "straight_tb"), "lm loss validation")[4]
    for rank in range(2):
        expected = _checkpoint(work / "straight", 4, rank)
        actual = _checkpoint(work / "resumed", 4, rank)
        for key in (name for name in expected if name.startswith("model")):
            assert expected[key].keys() == actual[key].keys()
            for name, value in expected[key].items():
                if torch.is_tensor(value):
                    assert torch.equal(value, actual[key][name]), (rank, key, name)
