"""Routed experts reshard too: a MoE model (4 experts, top-2, every layer) saved at EP=2 x DP=2 (4 gloo ranks)
with the plain and with the distributed optimizer (a chained optimizer: dense + expert params) loads at
EP=4, EP=1 (x DP=4), TP=2 x EP=2 and TP=2 x EP=4 with expert TP 1, into either optimizer, with the saving
run's logits and next loss
(fp32, 1e-5 relative as in test_resharding.py). Expert keys carry global expert numbers, so every layout
finds each expert's weights under its own number."""

import os

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron.core import parallel_state
from tests.unit_tests.dist_checkpointing.test_resharding import _load, _save
from tests.unit_tests.dist_checkpointing.tiny_gpt import build, full_logits, train_step
from tests.unit_tests.dist_utils import run_distributed

EXPERT = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc2.weight"
STORED_EXPERT = "decoder.layers.mlp.experts.local_experts.{}.linear_fc2.weight"  # layers stacked
# Loaded: (TP, expert TP (None: TP), EP, distributed optimizer, checkpoint)
TARGETS = [(1, None, 4, True, "plain"), (1, None, 1, False, "distributed"), (2, None, 2, True, "distributed"),
           (2, 1, 4, True, "plain")]


def _expert_weights(ddp) -> dict:
    """{global expert number: fc2 weight of layer 0} of this rank's experts."""
    params = dict(ddp.module.named_parameters())
    indices = ddp.module.decoder.layers[0].mlp.local_expert_indices
    return {expert: params[EXPERT.format(local)].detach().clone() for local, expert in enumerate(indices)}


def _expert_checks(rank, world_size, directory):
    saved = {}
    for name, distributed in (("plain", False), ("distributed", True)):
        ddp, optimizer = build(1, 1, distributed, seed=1, expert_parallel=2)
        for step in range(2):
            train_step(ddp, optimizer, step)
        logits, experts = full_logits(ddp), _expert_weights(ddp)
        _save(ddp, optimizer, os.path.join(directory, name))
        saved[name] = (logits, experts, train_step(ddp, optimizer, 2))
    loaded = []
    for tensor_parallel, expert_tensor_parallel, expert_parallel, distributed, name in TARGETS:
        ddp, optimizer = build(tensor_parallel, 1, distributed, seed=7, expert_parallel=expert_parallel,
                               expert_tensor_parallel=expert_tensor_parallel)
        _load(ddp, optimizer, os.path.join(directory, name))
        logits, experts = full_logits(ddp), _expert_weights(ddp)
        loaded.append((logits, experts, train_step(ddp, optimizer, 2)))
    parallel_state.destroy_model_parallel()
    return saved, loaded


def test_ep2_checkpoint_loads_at_ep4_ep1_tp2_ep2_and_expert_tp1(tmp_path):
    results = run_distributed(_expert_checks, 4, str(tmp_path))
    saved, loaded = results[0]
    for (tensor_parallel, expert_tensor_parallel, expert_parallel, distributed, name), (logits, _, loss) in zip(
            TARGETS, loaded):
        reference_logits, _, reference_loss = saved[name]
        where = (f"TP={tensor_parallel} ETP={expert_tensor_parallel} EP={expert_parallel} distributed={distributed} "
                 f"from {name}")
        torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5, msg=where)
        assert abs(loss - reference_loss) <= 1e-5 * abs(reference_loss), where

    # Every expert, as the EP=2 x DP=2 runs held them (each rank 2 of the 4).
    experts = {name: {expert: weight for rank in range(4) for expert, weight in results[rank][0][name][1].items()}
               for name in saved}
    assert sorted(experts["plain"]) == [0, 1, 2, 3]
    ep1 = loaded[TARGETS.index((1, None, 1, False, "distributed"))][1]
    assert sorted(ep1) == [0, 1, 2, 3] and all(torch.equal(ep1[e], experts["distributed"][e]) for e in range(4))
    ep4 = TARGETS.index((1, None, 4, True, "plain"))
    for rank in range(4):
        (expert, weight), = results[rank][1][ep4][1].items()
        assert expert == rank and torch.equal(weight, experts["plain"][rank])

    metadata = FileSystemReader(str(tmp_path / "plain")).read_metadata().state_dict_metadata
    assert all(STORED_EXPERT.format(index) in metadata for index in range(4))
