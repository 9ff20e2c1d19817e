"""Save at TP=2 x DP=2 (4 gloo ranks), load at TP=1 x DP=4 and TP=4 x DP=1, with the plain and the distributed
optimizer in every combination: the logits of a fixed batch and the loss of the next training step equal
those of the run that saved (fp32; the TP split changes the order of sums, hence 1e-5, measured ~1e-7),
and bitwise under the saving layout. The stored global tensors are checked against the TP shards by hand:
SwiGLU's fc1 is [gate_0; gate_1; up_0; up_1] of the two TP ranks' [gate_r; up_r]."""

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import load, load_common_state_dict, save
from megatron.core.dist_checkpointing.model_sharding import model_sharded_state_dict
from megatron.core.dist_checkpointing.optimizer_sharding import (
    optimizer_common_state,
    optimizer_sharded_state_dict,
    prepare_optimizer_for_load,
)
from tests.unit_tests.dist_checkpointing.tiny_gpt import build, full_logits, set_layout, train_step
from tests.unit_tests.dist_utils import run_distributed

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
# (TP size, distributed optimizer, checkpoint saved with the distributed optimizer)
TARGETS = [(2, True, True), (2, False, False), (1, True, False), (1, False, True), (4, False, True), (4, True, False)]


def _save(ddp, optimizer, directory) -> None:
    model = ddp.module
    save({"model": model_sharded_state_dict(model),
          "optimizer": {"common": optimizer_common_state(optimizer),
                        "sharded": optimizer_sharded_state_dict(optimizer, [model])}}, directory)


def _load(ddp, optimizer, directory) -> None:
    prepare_optimizer_for_load(optimizer, load_common_state_dict(directory)["optimizer"]["common"])
    load({"model": model_sharded_state_dict(ddp.module),
          "optimizer": optimizer_sharded_state_dict(optimizer, [ddp.module])}, directory)


def _local_fc1(ddp) -> torch.Tensor:
    return dict(ddp.module.named_parameters())[FC1].detach().clone()


def _reshard_checks(rank, world_size, directory):
    saved = {}
    for distributed in (False, True):
        set_layout(2)
        ddp, optimizer = build(2, distributed, seed=1)
        for step in range(2):
            train_step(ddp, optimizer, step)
        logits, fc1 = full_logits(ddp), _local_fc1(ddp)
        _save(ddp, optimizer, os.path.join(directory, f"distributed_{distributed}"))
        saved[distributed] = (logits, fc1, train_step(ddp, optimizer, 2))
    loaded = []
    for tensor_parallel_size, distributed, saved_with in TARGETS:
        set_layout(tensor_parallel_size)
        ddp, optimizer = build(tensor_parallel_size, distributed, seed=7)
        _load(ddp, optimizer, os.path.join(directory, f"distributed_{saved_with}"))
        logits, fc1 = full_logits(ddp), _local_fc1(ddp)
        loaded.append((logits, fc1, train_step(ddp, optimizer, 2)))
    dist.barrier()
    return saved, loaded


def test_checkpoint_saved_at_tp2_dp2_loads_at_tp1_and_tp4_with_either_optimizer(tmp_path):
    results = run_distributed(_reshard_checks, 4, str(tmp_path))
    saved, loaded = results[0]
    for (tensor_parallel_size, distributed, saved_with), (logits, _, loss) in zip(TARGETS, loaded):
        reference_logits, _, reference_loss = saved[saved_with]
        where = f"TP={tensor_parallel_size} distributed={distributed} from distributed={saved_with}"
        if tensor_parallel_size == 2 and distributed == saved_with:
            assert torch.equal(logits, reference_logits) and loss == reference_loss, where
        else:
            torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5, msg=where)
            assert abs(loss - reference_loss) <= 1e-5 * abs(reference_loss), where

    # TP=2 ranks 0 and 1 hold [gate_r; up_r] (24 + 24 rows each); TP=1 and the file hold [gate; up].
    tp_shards = [results[rank][0][False][1] for rank in (0, 1)]
    gate = torch.cat([shard[:24] for shard in tp_shards])
    up = torch.cat([shard[24:] for shard in tp_shards])
    assert torch.equal(loaded[TARGETS.index((1, True, False))][1], torch.cat([gate, up]))
    # TP=4 rank r holds [gate rows 6r..6r+5; up rows 6r..6r+5].
    tp4 = TARGETS.index((4, True, False))
    for rank in range(4):
        assert torch.equal(results[rank][1][tp4][1], torch.cat([gate[6 * rank : 6 * rank + 6],
                                                                  up[6 * rank : 6 * rank + 6]]))

    metadata = FileSystemReader(str(tmp_path / "distributed_True")).read_metadata().state_dict_metadata
    assert tuple(metadata[FC1].size) == (96, 32)
    assert tuple(metadata[f"optimizer.state.exp_avg.{FC1}"].size) == (96, 32)
    assert sorted(os.listdir(tmp_path / "distributed_True")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "common.pt", "metadata.json"]
