"""Save at TP=2 x PP=2 (4 gloo ranks) with the plain and with the distributed optimizer (its model-space
layout, --dist-ckpt-optim-fully-reshardable), load at TP=1 x PP=1 (x DP=4, into the other optimizer), TP=4 and
PP=4: the logits of a fixed batch and the loss of the next training step equal those of the run that saved
(fp32; another TP size changes the order of sums, hence 1e-5, measured ~1e-7), and bitwise under the saving
layout, also from the distributed optimizer's bucket layout (dp_reshardable). The stored global tensors are
checked against the TP shards by hand: SwiGLU's fc1 is [gate_0; gate_1; up_0; up_1] of the two TP ranks'
[gate_r; up_r], the layers stacked on a leading axis; the last stage's tied output weight is not stored."""

import os

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import load, load_common_state_dict, save
from megatron.core.dist_checkpointing.model_sharding import model_sharded_state_dict
from megatron.core.dist_checkpointing.optimizer_buckets import apply_bucket_state, bucket_sharded_state_dict
from megatron.core.dist_checkpointing.optimizer_sharding import (
    FULLY_RESHARDABLE,
    model_space_sharded_state_dict,
    optimizer_checkpoint_entry,
    prepare_optimizer_for_load,
    saved_entries,
    sub_optimizers,
)
from tests.unit_tests.dist_checkpointing.tiny_gpt import build, full_logits, train_step
from tests.unit_tests.dist_utils import run_distributed

FC1 = "decoder.layers.mlp.linear_fc1.weight"  # layer 3 on the last stage under PP=2 and PP=4
# Saved: name -> (TP, PP, distributed optimizer, fully reshardable)
SAVED = {"plain": (2, 2, False, False), "distributed": (2, 2, True, True), "buckets": (2, 2, True, False)}
# Loaded: (TP, PP, distributed optimizer, checkpoint); TP=1 x PP=1 runs at DP=4 and takes the other optimizer.
TARGETS = [
    (2, 2, True, "distributed"), (2, 2, True, "buckets"),
    (1, 1, True, "plain"), (4, 1, False, "plain"), (1, 4, False, "plain"),
    (1, 1, False, "distributed"), (4, 1, True, "distributed"), (1, 4, True, "distributed"),
]


def _save(ddp, optimizer, directory, fully_reshardable=True) -> None:
    model = ddp.module
    entry, _ = optimizer_checkpoint_entry(optimizer, [model], fully_reshardable)
    save({"model": model_sharded_state_dict(model), "optimizer": entry}, directory)


def _load(ddp, optimizer, directory) -> None:
    entries = saved_entries(load_common_state_dict(directory)["optimizer"])
    request = {"model": model_sharded_state_dict(ddp.module)}
    if entries[0].get("param_state_sharding_type") == "dp_reshardable":
        (sub,) = sub_optimizers(optimizer)
        request["optimizer"] = bucket_sharded_state_dict(sub, fill=False)
        loaded = load(request, directory)
        prepare_optimizer_for_load(optimizer, [loaded["optimizer"]])
        apply_bucket_state(sub, request["optimizer"])
        return
    prepare_optimizer_for_load(optimizer, entries)
    main_key = "param" if entries[0].get("param_state_sharding_type") == FULLY_RESHARDABLE else "fp32_param"
    request["optimizer"] = model_space_sharded_state_dict(optimizer, [ddp.module], main_key, is_loading=True)
    load(request, directory)


def _local_fc1(ddp) -> torch.Tensor:
    """This rank's piece of FC1 (None on the stages without it)."""
    params = {name: param for name, param in ddp.module.named_parameters()}
    local_name = [name for name in params if name.endswith("mlp.linear_fc1.weight")][-1]
    return params[local_name].detach().clone() if parallel_state.is_pipeline_last_stage() else None


def _reshard_checks(rank, world_size, directory):
    saved = {}
    for name, (tensor_parallel, pipeline_parallel, distributed, fully_reshardable) in SAVED.items():
        ddp, optimizer = build(tensor_parallel, pipeline_parallel, distributed, seed=1)
        for step in range(2):
            train_step(ddp, optimizer, step)
        logits, fc1 = full_logits(ddp), _local_fc1(ddp)
        _save(ddp, optimizer, os.path.join(directory, name), fully_reshardable)
        saved[name] = (logits, fc1, train_step(ddp, optimizer, 2))
    loaded = []
    for tensor_parallel, pipeline_parallel, distributed, name in TARGETS:
        ddp, optimizer = build(tensor_parallel, pipeline_parallel, distributed, seed=7)
        _load(ddp, optimizer, os.path.join(directory, name))
        logits, fc1 = full_logits(ddp), _local_fc1(ddp)
        loaded.append((logits, fc1, train_step(ddp, optimizer, 2)))
    parallel_state.destroy_model_parallel()
    return saved, loaded


def test_tp2_pp2_checkpoint_loads_at_tp1_tp4_pp4_with_either_optimizer(tmp_path):
    results = run_distributed(_reshard_checks, 4, str(tmp_path))
    saved, loaded = results[0]
    for (tensor_parallel, pipeline_parallel, distributed, name), (logits, _, loss) in zip(TARGETS, loaded):
        reference_logits, _, reference_loss = saved[name]
        where = f"TP={tensor_parallel} PP={pipeline_parallel} distributed={distributed} from {name}"
        if (tensor_parallel, pipeline_parallel, distributed) == SAVED[name][:3]:
            assert torch.equal(logits, reference_logits) and loss == reference_loss, where
        else:
            torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5, msg=where)
            assert abs(loss - reference_loss) <= 1e-5 * abs(reference_loss), where

    # Last-stage TP ranks of TP=2 x PP=2 (global ranks 2, 3) hold [gate_r; up_r], 24 + 24 rows each.
    tp_shards = [results[rank][0]["plain"][1] for rank in (2, 3)]
    gate = torch.cat([shard[:24] for shard in tp_shards])
    up = torch.cat([shard[24:] for shard in tp_shards])
    assert torch.equal(loaded[TARGETS.index((1, 1, True, "plain"))][1], torch.cat([gate, up]))
    # TP=4 rank r holds [gate rows 12r..12r+11; up rows 12r..12r+11].
    tp4 = TARGETS.index((4, 1, False, "plain"))
    for rank in range(4):
        rows = slice(12 * rank, 12 * rank + 12)
        assert torch.equal(results[rank][1][tp4][1], torch.cat([gate[rows], up[rows]]))

    directory = tmp_path / "plain"
    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    assert tuple(metadata[FC1].size) == (4, 96, 32)
    assert tuple(metadata[f"optimizer.state.exp_avg.{FC1}"].size) == (4, 96, 32)
    assert "output_layer.weight" not in metadata and tuple(metadata["embedding.word_embeddings.weight"].size) == (
        256, 32)
    assert sorted(os.listdir(directory)) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "metadata.json"]
