"""`save` and `load` of a sharded state dict in Megatron-Core's `torch_dist` directory layout:

    <dir>/metadata.json       {"sharded_backend": "torch_dist", ...}: marks a distributed checkpoint
    <dir>/common.pt           everything that is not a ShardedTensor/ShardedObject (rank 0 writes it)
    <dir>/.metadata           DCP's index: per global key its shape, dtype and chunks
    <dir>/__{rank}_0.distcp   the chunks each rank wrote

A state dict is a nested dict whose leaves are ShardedTensors, ShardedObjects, lists of ShardedTensors,
or anything else (common). Saving is collective over all ranks; each writes the boxes of its main
replicas. Loading is collective too; each rank reads what it holds now, from whatever layout saved it.
metadata.json is written last, so a directory without it was never completely written.
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
from megatron.core.dist_checkpointing.async_save import AsyncSaveRequest
from megatron.core.dist_checkpointing.dcp_planners import ShardedLoadPlanner, ShardedSavePlanner, TensorBox
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strictness import (
    check_strictness,
    looks_for_missing,
    report_missing,
    returns_mismatches,
)

METADATA_FILENAME = "metadata.json"
COMMON_FILENAME = "common.pt"
# Megatron-Core's CheckpointingConfig fields.
CHECKPOINT_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}

_SHARDED = (ShardedTensor, ShardedObject)
# world group -> the gloo group DCP uses under it: remade when torch.distributed is re-initialised, and freed
# (its worker threads joined) with the world group once destroy_process_group has dropped that.
_checkpoint_groups = weakref.WeakKeyDictionary()


def _is_sharded(value) -> bool:
    if isinstance(value, _SHARDED):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(item, ShardedTensor) for item in value)


def split_state_dict(state_dict: dict) -> Tuple[dict, List[ShardedTensor], List[ShardedObject]]:
    """(common part, sharded tensors, sharded objects) of a nested state dict."""
    common, tensors, objects = {}, [], []
    for key, value in state_dict.items():
        if isinstance(value, dict):
            common[key], more_tensors, more_objects = split_state_dict(value)
            tensors += more_tensors
            objects += more_objects
        elif isinstance(value, ShardedObject):
            objects.append(value)
        elif _is_sharded(value):
            tensors += [value] if isinstance(value, ShardedTensor) else list(value)
        else:
            common[key] = value
    return common, tensors, objects


def _merge_loaded(state_dict: dict, common: dict, objects: Dict[str, object]) -> dict:
    """`state_dict` with loaded values in place of its sharded leaves, merged into `common`."""
    merged = dict(common)
    for key, value in state_dict.items():
        if isinstance(value, dict):
            merged[key] = _merge_loaded(value, common.get(key, {}), objects)
        elif isinstance(value, ShardedObject):
            merged[key] = objects.get(value.unique_key)
        elif _is_sharded(value):
            merged[key] = value.data if isinstance(value, ShardedTensor) else [piece.data for piece in value]
    return merged


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


def _write(checkpoint_dir, boxes, objects, common, process_group) -> None:
    dcp.save(
        {},
        storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=1),
        planner=ShardedSavePlanner(boxes, objects),
        process_group=process_group,
        no_dist=process_group is None,
    )
    if _is_writer_of_common():
        write_atomically(os.path.join(checkpoint_dir, COMMON_FILENAME), lambda file: torch.save(common, file))
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
    written_objects = {item.unique_key: item.data for item in objects if is_main_replica(item.replica_id)}
    os.makedirs(checkpoint_dir, exist_ok=True)
    process_group = _process_group()
    if not async_sharded_save:
        _write(checkpoint_dir, boxes, written_objects, common, process_group)
        return None
    # A snapshot: training goes on changing the live tensors while the thread writes.
    snapshot = [TensorBox(box.key, box.offset, box.tensor.detach().to("cpu", copy=True), box.global_shape)
                for box in boxes]
    written_objects, common = copy.deepcopy(written_objects), copy.deepcopy(common)
    return AsyncSaveRequest(lambda: _write(checkpoint_dir, snapshot, written_objects, common, process_group))


def load_common_state_dict(checkpoint_dir) -> dict:
    """The common part (`common.pt`) of a distributed checkpoint, with clear errors when absent."""
    if not is_distributed_checkpoint(checkpoint_dir):
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a complete distributed checkpoint: it has no {METADATA_FILENAME} (an "
            "interrupted save, or a --ckpt-format torch checkpoint)"
        )
    return torch.load(os.path.join(checkpoint_dir, COMMON_FILENAME), map_location="cpu", weights_only=False)


def saved_keys(checkpoint_dir) -> set:
    """The global keys of the tensors and objects a distributed checkpoint holds (from DCP's index)."""
    return set(dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata)


def _missing_keys(checkpoint_dir, requested: set, process_group) -> List[str]:
    """Checkpoint keys that no rank asked for (collective: the ranks' requests are gathered)."""
    everyone = [requested]
    if process_group is not None:
        everyone = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(everyone, requested, group=process_group)
    return sorted(saved_keys(checkpoint_dir) - set().union(*everyone))


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
