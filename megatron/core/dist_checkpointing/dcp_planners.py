"""The bridge to `torch.distributed.checkpoint` (DCP): planners that write and read boxes of global tensors.

DCP stores, per global key, a list of chunks (offset + size inside the global shape) in `.metadata` and
the chunk data in `__{rank}_{k}.distcp` files. Saving, each rank offers the boxes of its main-replica
pieces (`ShardedTensor.boxes()`); the coordinator checks that the boxes of every key tile its global
tensor exactly (no gap, no overlap). Loading, each rank asks for the boxes it holds now; DCP's
resharding (`create_read_items_for_chunk_list`) intersects them with the saved chunks, whatever layout
wrote them, and the reader copies each intersection into a view of the live tensor.
"""

import io
import math
from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.core.dist_checkpointing.strictness import report_unexpected
from megatron.core.dist_checkpointing.unpickling import tolerant_pickle_module

# (global key, offset of the box in the global tensor)
BoxId = Tuple[str, Tuple[int, ...]]


class TensorBox:
    """A box of the global tensor `key` ([global_shape]) held by this rank in `tensor`, at `offset`."""

    def __init__(self, key: str, offset: Tuple[int, ...], tensor: torch.Tensor, global_shape: Tuple[int, ...],
                 allow_shape_mismatch: bool = False):
        self.key, self.offset, self.tensor = key, tuple(offset), tensor
        self.global_shape, self.allow_shape_mismatch = tuple(global_shape), allow_shape_mismatch


class ShardedSavePlanner(SavePlanner):
    """Writes `boxes` (tensors) and `objects` ({storage key: picklable}) of this rank."""

    def __init__(self, boxes: List[TensorBox], objects: Dict[str, object]):
        self.boxes = {(box.key, box.offset): box for box in boxes}
        if len(self.boxes) != len(boxes):
            raise ValueError("two pieces of one rank claim the same place of a global tensor")
        self.objects = objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(box.key, torch.Size(box.offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=box.tensor.shape),
                    properties=TensorProperties(dtype=box.tensor.dtype),
                    size=torch.Size(box.global_shape),
                ),
            )
            for box in self.boxes.values()
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        global_plan, metadata = create_default_global_save_plan(all_plans)
        problems = _tiling_problems(metadata)
        if problems:
            raise ValueError(
                "the ranks' pieces do not tile the global tensors exactly (a layout bug, not a user error): "
                + "; ".join(problems[:5])
            )
        return global_plan, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            # Megatron-Core stores the list of a rank's objects under one key (one object here).
            torch.save([self.objects[write_item.index.fqn]], buffer)
            buffer.seek(0)
            return buffer
        return self.boxes[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach()


class ShardedLoadPlanner(LoadPlanner):
    """Reads into `boxes` (views of live tensors, filled in place) and the objects named `object_keys`
    (returned in `loaded_objects`). Global shapes that differ raise a ValueError while planning, which DCP
    reports from every rank; keys absent from the checkpoint (`unexpected_keys`) too, or are skipped, as
    the strictness policy says (strictness.py)."""

    def __init__(self, checkpoint_dir: str, boxes: List[TensorBox], object_keys: List[str],
                 strict: str = "assume_ok_unexpected"):
        self.checkpoint_dir, self.strict = checkpoint_dir, strict
        self.boxes = {(box.key, box.offset): box for box in boxes}
        self.object_keys = object_keys
        self.loaded_objects: Dict[str, object] = {}
        self.unexpected_keys: List[str] = []
        self.shape_mismatches: List[str] = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def _chunk(self, box: TensorBox, saved_size) -> ChunkStorageMetadata:
        """The part of `box` the checkpoint can fill: all of it, or (padded dims) the overlap."""
        sizes = list(box.tensor.shape)
        if tuple(saved_size) != box.global_shape:
            if not box.allow_shape_mismatch or len(saved_size) != len(sizes):
                self.shape_mismatches.append(
                    f"{box.key}: checkpoint {tuple(saved_size)}, this run {box.global_shape}"
                )
                return None
            sizes = [max(0, min(size, total - offset)) for size, total, offset in zip(sizes, saved_size, box.offset)]
        return ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(sizes))

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items: List[ReadItem] = []
        for box in self.boxes.values():
            if box.key not in saved:
                self.unexpected_keys.append(box.key)
                continue
            chunk = self._chunk(box, saved[box.key].size)
            if chunk is not None and all(chunk.sizes):
                items += create_read_items_for_chunk_list(box.key, saved[box.key], [chunk])
        for key in self.object_keys:
            if key not in saved:
                self.unexpected_keys.append(key)
                continue
            items.append(_object_read_item(key))
        if self.shape_mismatches:
            raise ValueError(f"distributed checkpoint {self.checkpoint_dir} does not fit this model: global shapes "
                             "differ: " + "; ".join(self.shape_mismatches[:8]))
        self.unexpected_keys = sorted(set(self.unexpected_keys))
        report_unexpected(self.strict, self.checkpoint_dir, self.unexpected_keys)
        self.plan = LoadPlan(items)
        return self.plan

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded_objects[read_item.dest_index.fqn] = load_object(value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        box = self.boxes[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        view = box.tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: `resolve_tensor` handed out a view of the live tensor, which the reader filled."""


def load_object(stream) -> object:
    """A ShardedObject's payload: the list of the saving rank's objects (Megatron-Core's), whose first is
    the object; classes this installation lacks become placeholders (unpickling.py)."""
    objects = torch.load(stream, map_location="cpu", weights_only=False, pickle_module=tolerant_pickle_module)
    if not isinstance(objects, list) or len(objects) != 1:
        raise ValueError(f"a checkpoint object should be stored as a list of one, found {type(objects).__name__}")
    return objects[0]


def _object_read_item(key: str) -> ReadItem:
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(key),
        dest_offsets=torch.Size((0,)),
        storage_index=MetadataIndex(key),
        storage_offsets=torch.Size((0,)),
        lengths=torch.Size((0,)),
    )


def _tiling_problems(metadata: Metadata) -> List[str]:
    """Keys whose saved chunks leave the global shape, or do not add up to it.

    Our own check rather than DCP's private `_validate_global_plan`, whose return type changed between
    torch releases (a bool in 2.11, a list of messages in 2.13). In-bounds chunks at distinct offsets whose
    volumes sum to the tensor's tile it unless a gap and an overlap cancel, which no layout here produces;
    a pairwise overlap test would cost ranks^2 per key.
    """
    problems = []
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        volume = 0
        for chunk in meta.chunks:
            if any(o < 0 or o + n > size for o, n, size in zip(chunk.offsets, chunk.sizes, meta.size)):
                problems.append(f"{key}: a piece at {tuple(chunk.offsets)} of shape {tuple(chunk.sizes)} lies "
                                f"outside the global shape {tuple(meta.size)}")
            volume += math.prod(chunk.sizes)
        if len({tuple(c.offsets) for c in meta.chunks}) != len(meta.chunks):
            problems.append(f"{key}: two pieces start at the same offset")
        elif volume != math.prod(meta.size):
            problems.append(f"{key}: the pieces cover {volume} of {math.prod(meta.size)} elements")
    return problems
