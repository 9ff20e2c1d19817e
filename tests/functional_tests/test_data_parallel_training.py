"""Data parallelism end to end: pretrain_gpt.py under torchrun with 2 CPU ranks (gloo), mock data.

DP=2 with the distributed optimizer, overlapped bucket reductions and overlapped parameter all-gathers
trains like one process on the same global batch in twice the microbatches; a run resumed from its
checkpoint (model_optim_rng.pt + distrib_optim.pt) continues bit for bit.
"""

import os

import pytest
import torch
import torch.distributed.run

from .harness import ROOT, read_scalars, run

ITERATIONS = 6
# Global batch 8 = micro batch 4 x (2 microbatches on one rank, or 1 on each of two ranks). No dropout:
# the two layouts draw their masks in different orders.
COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--log-interval", "1", "--num-workers", "0", "--eval-interval", "1000", "--eval-iters", "1",
]
# ~20k-element buckets: several reductions launched during backward, several gathers during forward.
DATA_PARALLEL = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                 "--ddp-bucket-size", "20000"]


def _torchrun(args: list[str]) -> None:
    """`torchrun --nproc_per_node 2 pretrain_gpt.py <args>` on the CPU (torchrun is torch/distributed/run.py)."""
    launcher = ["--nproc_per_node", "2", "--standalone", os.path.join(ROOT, "pretrain_gpt.py")]  # a free port
    run(torch.distributed.run.__file__, launcher + args, env={"CUDA_VISIBLE_DEVICES": ""})


def _checkpoint(save_dir, name: str) -> dict:
    return torch.load(os.path.join(save_dir, f"iter_{ITERATIONS:07d}", "mp_rank_00", name), map_location="cpu",
                      weights_only=False)


def _final_tensors(save_dir) -> dict:
    """The weights, and the main params and Adam moments of the (one) buffer, saved at the last iteration."""
    model = _checkpoint(save_dir, "model_optim_rng.pt")["model"]
    [optimizer] = _checkpoint(save_dir, "distrib_optim.pt")[0].values()
    tensors = {f"model {key}": value for key, value in model.items()}
    tensors.update({f"distrib_optim.pt {key}": value for key, value in optimizer.items()})
    return {key: value for key, value in tensors.items() if torch.is_tensor(value)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("data_parallel")
    run("pretrain_gpt.py", COMMON + ["--tensorboard-dir", str(work / "single_tb")], env={"CUDA_VISIBLE_DEVICES": ""})
    _torchrun(COMMON + DATA_PARALLEL + ["--save", str(work / "ckpt"), "--save-interval", "3", "--ckpt-format", "torch",
                                        "--tensorboard-dir", str(work / "dp2_tb")])
    _torchrun(COMMON + DATA_PARALLEL + ["--load", str(work / "ckpt"), "--ckpt-step", "3",
                                        "--save", str(work / "resumed_ckpt"), "--save-interval", "3",
                                        "--ckpt-format", "torch",
                                        "--tensorboard-dir", str(work / "resumed_tb")])
    return work


def test_two_data_parallel_ranks_train_like_one_process(runs):
    single = read_scalars(str(runs / "single_tb"), "lm loss")
    data_parallel = read_scalars(str(runs / "dp2_tb"), "lm loss")
    assert sorted(single) == sorted(data_parallel) == list(range(1, ITERATIONS + 1))
    assert data_parallel[ITERATIONS] < data_parallel[1]
    # The same samples in another split; the fp32 gradient sums and the sharded norm add up in another order.
    for step in single:
        assert data_parallel[step] == pytest.approx(single[step], rel=1e-5), f"lm loss at iteration {step}"


def test_resume_with_the_distributed_optimizer_is_exact(runs):
    straight = read_scalars(str(runs / "dp2_tb"), "lm loss")
    resumed = read_scalars(str(runs / "resumed_tb"), "lm loss")
    assert sorted(resumed) == list(range(4, ITERATIONS + 1))
    assert [resumed[step] for step in resumed] == [straight[step] for step in resumed]
    expected, actual = _final_tensors(runs / "ckpt"), _final_tensors(runs / "resumed_ckpt")
    assert expected.keys() == actual.keys() and any(key.startswith("distrib_optim.pt") for key in expected)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_distrib_optim_file_has_megatron_layout(runs):
    state = _checkpoint(runs / "ckpt", "distrib_optim.pt")
    assert state["buckets_coalesced"] is True and sorted(key for key in state if key != "buckets_coalesced") == [0]
    [(dtypes, buffer_state)] = state[0].items()
    assert dtypes == (torch.float32, torch.float32)
    numel = buffer_state["numel_unpadded"]
    assert {key: value.shape for key, value in buffer_state.items() if key != "numel_unpadded"} == {
        "param": (numel,), "exp_avg": (numel,), "exp_avg_sq": (numel,)}
    model = _checkpoint(runs / "ckpt", "model_optim_rng.pt")
    # Without the param state in it, the model file's optimizer entry holds only the param groups.
    assert all("params" not in group for group in model["optimizer"]["optimizer"]["param_groups"])
    assert numel >= sum(tensor.numel() for tensor in model["model"].values() if torch.is_tensor(tensor)) > 0


def test_megatron_fsdp_trains_like_one_process(runs, tmp_path):
    """--use-megatron-fsdp (its default strategy optim_grads_params: ZeRO-3 on DDP's buffers) with Megatron's overlap flags,
    through pretrain_gpt.py: the losses and gradient norms of one process, to rounding."""
    _torchrun(COMMON + ["--use-megatron-fsdp", "--overlap-grad-reduce", "--overlap-param-gather",
                        "--tensorboard-dir", str(tmp_path / "fsdp_tb")])
    for tag in ("lm loss", "grad-norm"):
        single = read_scalars(str(runs / "single_tb"), tag)
        fully_sharded = read_scalars(str(tmp_path / "fsdp_tb"), tag)
        assert sorted(fully_sharded) == list(range(1, ITERATIONS + 1))
        for step in single:
            assert fully_sharded[step] == pytest.approx(single[step], rel=1e-5), f"{tag} at iteration {step}"
