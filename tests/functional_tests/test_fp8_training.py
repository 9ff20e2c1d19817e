"""pretrain_gpt.py with --fp8-format hybrid on the CPU (torch._scaled_mm computes the FP8 products there).

A tiny GPT (mock data, bf16, delayed scaling with an amax history of 4 and the "max" rule) trains 6
iterations and its loss falls; a second run loads the checkpoint of iteration 3 and its losses at 4..6 equal
the uninterrupted run's bitwise. With amax history and scales not restored the resumed run would quantize
with other scales (scale 1) and differ, so this shows the scaling state is in the checkpoint.
"""

import torch

from .harness import read_scalars
from .test_tensor_parallel_training import TINY, pretrain_gpt

FP8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]


def test_fp8_run_trains_and_resumes_exactly(tmp_path):
    common = TINY + FP8 + ["--train-iters", "6", "--ckpt-format", "torch"]
    pretrain_gpt(1, common + ["--save", str(tmp_path / "ckpt"), "--save-interval", "3",
                              "--tensorboard-dir", str(tmp_path / "straight")])
    pretrain_gpt(1, common + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3",
                              "--tensorboard-dir", str(tmp_path / "resumed")])
    straight = read_scalars(str(tmp_path / "straight"), "lm loss")
    resumed = read_scalars(str(tmp_path / "resumed"), "lm loss")
    assert sorted(straight) == list(range(1, 7)) and sorted(resumed) == [4, 5, 6]
    assert straight[6] < straight[1] - 0.2
    assert [resumed[step] for step in (4, 5, 6)] == [straight[step] for step in (4, 5, 6)]
    saved = torch.load(tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt",
                       map_location="cpu", weights_only=False)["model"]
    states = {name: value for name, value in saved.items() if name.endswith("_extra_state") and value is not None}
    assert len(states) == 8  # 2 layers x (qkv, proj, fc1, fc2)
    assert saved["output_layer._extra_state"] is None  # no FP8 there; written as Megatron-Core's linears do
    assert all(state.shape == (5, 3) and (state[-3:] > 0).all() for state in states.values())
