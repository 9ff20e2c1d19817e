"""`save` and `load` of a sharded state dict in Megatron-Core's `torch_dist` directory layout:

    <dir>/metadata.json       {"sharded_backend": "torch_dist", "sharded_backend_version": 1}: marks a
                              complete distributed checkpoint
    <dir>/.metadata           DCP's index: per global key its shape, dtype and chunks
    <dir>/__{rank}_0.distcp   the chunks each rank wrote, and the objects: `common_state/shard_0_1` holds
                              everything that is not a ShardedTensor/ShardedObject (rank 0 writes it)

A state dict is a nested dict whose leaves are ShardedTensors, ShardedObjects, lists of ShardedTensors,
or anything else (common). Saving is collective over all ranks; each writes the boxes of its main
replicas. Loading is collective too; each rank reads what it holds now, from whatever layout saved it.
metadata.json is written last, so a directory without it was never completely written. Checkpoints of
Megatron-Core before 2026 keep the common part in `<dir>/common.pt` instead: it is read when present.
"""

import copy
import json
import os
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.atomic_write import write_atomically
from megatron.core.datasets.rank_logging import global_rank
from megatron.core.dist_checkpointing.async_save import AsyncSaveRequest
from megatron.core.dist_checkpointing.dcp_planners import ShardedLoadPlanner, ShardedSavePlanner, TensorBox
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strictness import (
    check_strictness,
    looks_for_missing,
    report_missing,
    returns_mismatches,
)
from megatron.core.dist_checkpointing.unpickling import tolerant_pickle_module

METADATA_FILENAME = "metadata.json"
LEGACY_COMMON_FILENAME = "common.pt"
COMMON_STATE_KEY = "common_state"
# Megatron-Core's CheckpointingConfig fields.
CHECKPOINT_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}

_SHARDED = (ShardedTensor, ShardedObject)
# world group -> the gloo group DCP uses under it: remade when torch.distributed is re-initialised, and freed
# (its worker threads joined) with the world group once destroy_process_group has dropped that.
_checkpoint_groups = weakref.WeakKeyDictionary()


def _split(value, tensors: List[ShardedTensor], objects: List[ShardedObject]):
    """The common part of `value` (None when it is all sharded); its sharded leaves go to the lists.
    As Megatron-Core's `extract_matching_values`: a dict or list keeps its hierarchy, a list its common items
    in order, and a non-empty container whose items are all sharded is left out."""
    if isinstance(value, ShardedObject):
        objects.append(value)
        return _ALL_SHARDED
    if isinstance(value, ShardedTensor):
        tensors.append(value)
        return _ALL_SHARDED
    if isinstance(value, dict):
        kept = {key: _split(item, tensors, objects) for key, item in value.items()}
        kept = {key: item for key, item in kept.items() if item is not _ALL_SHARDED}
        return _ALL_SHARDED if value and not kept else kept
    if isinstance(value, list):
        kept = [item for item in (_split(item, tensors, objects) for item in value) if item is not _ALL_SHARDED]
        return _ALL_SHARDED if value and not kept else kept
    return value


_ALL_SHARDED = object()


def split_state_dict(state_dict: dict) -> Tuple[dict, List[ShardedTensor], List[ShardedObject]]:
    """(common part, sharded tensors, sharded objects) of a nested state dict (see `_split`)."""
    tensors, objects = [], []
    common = _split(state_dict, tensors, objects)
    return ({} if common is _ALL_SHARDED else common), tensors, objects


def _merge_loaded(request, common, objects: Dict[str, object]):
    """`request` with loaded values in place of its sharded leaves (tensor data, loaded objects), merged
    into the checkpoint's `common` part."""
    if isinstance(request, ShardedTensor):
        return request.data
    if isinstance(request, ShardedObject):
        return objects.get(request.unique_key)
    if isinstance(request, dict):
        merged = dict(common) if isinstance(common, dict) else {}
        for key, value in request.items():
            merged[key] = _merge_loaded(value, merged.get(key), objects)
        return merged
    if isinstance(request, list):
        return [_merge_loaded(item, None, objects) for item in request]
    return request if common is None else common


def _process_group():
    """The group DCP's planning collectives run over: the world, through gloo (DCP exchanges pickled
    plans, and a background save needs a group of its own). Created by the first call, on all ranks."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if world not in _checkpoint_groups:
        _checkpoint_groups[world] = dist.new_group(backend="gloo")
    return _checkpoint_groups[world]


def _is_writer_of_common() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def is_distributed_checkpoint(checkpoint_dir) -> bool:
    """True when `checkpoint_dir` holds a completely written distributed checkpoint (its metadata.json)."""
    return os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILENAME))


def _common_object(common: dict) -> ShardedObject:
    """The common part as Megatron-Core stores it: one object, written by rank 0."""
    return ShardedObject(COMMON_STATE_KEY, common, (1,), (0,), replica_id=global_rank())


def _write(checkpoint_dir, boxes, objects, process_group) -> None:
    dcp.save(
        {},
        storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=1),
        planner=ShardedSavePlanner(boxes, objects),
        process_group=process_group,
        no_dist=process_group is None,
    )
    if _is_writer_of_common():
        text = json.dumps(CHECKPOINT_METADATA).encode()
        write_atomically(os.path.join(checkpoint_dir, METADATA_FILENAME), lambda file: file.write(text))


def save(state_dict: dict, checkpoint_dir: str, async_sharded_save: bool = False) -> Optional[AsyncSaveRequest]:
    """Writes `state_dict` to `checkpoint_dir` (collective over all ranks).

    With `async_sharded_save`, the tensors are copied here and written by a background thread; the
    returned request's `finalize()` waits for it (collectively, on every rank) and raises its error.
    """
    common, tensors, objects = split_state_dict(state_dict)
    boxes = [
        TensorBox(tensor.key, offset, data, tensor.global_shape)
        for tensor in tensors if is_main_replica(tensor.replica_id)
        for offset, data in tensor.boxes()
    ]
    objects = objects + [_common_object(common)]
    written_objects = {item.unique_key: item.data for item in objects if is_main_replica(item.replica_id)}
    os.makedirs(checkpoint_dir, exist_ok=True)
    process_group = _process_group()
    if not async_sharded_save:
        _write(checkpoint_dir, boxes, written_objects, process_group)
        return None
    # A snapshot: training goes on changing the live tensors while the thread writes.
    snapshot = [TensorBox(box.key, box.offset, box.tensor.detach().to("cpu", copy=True), box.global_shape)
                for box in boxes]
    written_objects = copy.deepcopy(written_objects)
    return AsyncSaveRequest(lambda: _write(checkpoint_dir, snapshot, written_objects, process_group))


def load_common_state_dict(checkpoint_dir) -> dict:
    """The common part of a distributed checkpoint (its `common_state` object, or a legacy `common.pt`),
    with clear errors when absent. Every rank reads it by itself."""
    if not is_distributed_checkpoint(checkpoint_dir):
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a complete distributed checkpoint: it has no {METADATA_FILENAME} (an "
            "interrupted save, or a --ckpt-format torch checkpoint)"
        )
    legacy = os.path.join(checkpoint_dir, LEGACY_COMMON_FILENAME)
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=False, pickle_module=tolerant_pickle_module)
    return load_objects(checkpoint_dir, [_common_object(None).unique_key])[_common_object(None).unique_key]


def load_objects(checkpoint_dir, keys: List[str]) -> Dict[str, object]:
    """{unique key: object} of the ShardedObjects `keys` of a distributed checkpoint (no collective)."""
    missing = [key for key in keys if key not in saved_keys(checkpoint_dir)]
    if missing:
        raise ValueError(f"distributed checkpoint {checkpoint_dir} has no {', '.join(missing)}")
    planner = ShardedLoadPlanner(checkpoint_dir, [], keys)
    dcp.load({}, storage_reader=dcp.FileSystemReader(checkpoint_dir), planner=planner, no_dist=True)
    return planner.loaded_objects


def saved_keys(checkpoint_dir) -> set:
    """The global keys of the tensors and objects a distributed checkpoint holds (from DCP's index)."""
    return set(dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata)


def saved_tensors(checkpoint_dir) -> Dict[str, Tuple[tuple, torch.dtype]]:
    """{global key: (global shape, dtype)} of the tensors of a distributed checkpoint."""
    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    return {key: (tuple(value.size), value.properties.dtype) for key, value in metadata.items()
            if hasattr(value, "size")}


def saved_tensor_shapes(checkpoint_dir) -> Dict[str, tuple]:
    """{global key: global shape} of the tensors of a distributed checkpoint."""
    return {key: shape for key, (shape, _) in saved_tensors(checkpoint_dir).items()}


def _missing_keys(checkpoint_dir, requested: set, process_group) -> List[str]:
    """Checkpoint keys that no rank asked for (collective: the ranks' requests are gathered)."""
    everyone = [requested]
    if process_group is not None:
        everyone = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, requested, group=process_group)
    saved = {key for key in saved_keys(checkpoint_dir) if not key.startswith(COMMON_STATE_KEY + "/")}
    return sorted(saved - set().union(*everyone))


def load(state_dict: dict, checkpoint_dir: str, strict: str = "assume_ok_unexpected"):
    """Loads `checkpoint_dir` into the sharded leaves of `state_dict` (collective over all ranks).

    ShardedTensors are filled in place (their data are usually the live parameters); the returned dict
    has the loaded tensors and objects in place of the sharded leaves, merged with the common part.
    Global shapes that differ (other than padded dims marked `allow_shape_mismatch`) raise a ValueError
    naming them; keys that do not match are handled as `strict` says (strictness.py): by default keys
    missing from the checkpoint raise and extra ones are ignored. With strict "return_unexpected" /
    "return_all" the result is (dict, unexpected keys, missing keys), as in Megatron-Core.
    """
    check_strictness(strict)
    common = load_common_state_dict(checkpoint_dir)
    _, tensors, objects = split_state_dict(state_dict)
    boxes = [
        TensorBox(tensor.key, offset, data, tensor.global_shape, tensor.allow_shape_mismatch)
        for tensor in tensors for offset, data in tensor.boxes()
    ]
    object_keys = [item.unique_key for item in objects]
    process_group = _process_group()
    missing = []
    if looks_for_missing(strict):
        missing = _missing_keys(checkpoint_dir, {box.key for box in boxes} | set(object_keys), process_group)
        report_missing(strict, checkpoint_dir, missing)
    planner = ShardedLoadPlanner(checkpoint_dir, boxes, object_keys, strict)
    try:
        dcp.load({}, storage_reader=dcp.FileSystemReader(checkpoint_dir), planner=planner,
                 process_group=process_group, no_dist=process_group is None)
    except CheckpointException as error:
        causes = {str(failure[0] if isinstance(failure, tuple) else failure) for failure in error.failures.values()}
        raise ValueError("; ".join(sorted(causes))) from error
    merged = _merge_loaded(state_dict, common, planner.loaded_objects)
    if returns_mismatches(strict):
        return merged, planner.unexpected_keys, missing
    return merged
