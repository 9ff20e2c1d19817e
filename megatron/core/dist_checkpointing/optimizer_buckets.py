"""The distributed optimizer's default torch_dist layout, Megatron-Core's "dp_reshardable": the state of
each bucket of its DDP buffers as flat global tensors (m = rank in the model-parallel TP x PP group, for routed experts in the expert-TP x EP x PP one,
g = buffer, b = bucket, dtypes = (param dtype, grad dtype) of the buffer):

    optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{g}.dtype_{dtypes}.bucket_idx_{b}.{param|exp_avg|exp_avg_sq}
        [numel_unpadded of the bucket]   data-parallel rank r writes its shard [r*S, (r+1)*S) (S = padded
                                         numel / dp) cut at numel_unpadded; the gaps between params are zeros
    optimizer.distributed.dp_group_idx_{m}.per_bucket_numel[_unpadded]   objects: per buffer
                                         {dtypes: [padded (unpadded) numel of each bucket]}
    optimizer.distributed.dp_group_idx_{m}.optimizer                     object: {"param_groups": [... "step"]}
    "param_state_sharding_type": "dp_reshardable"                        (common state)

`param` is the fp32 main param. Offsets inside a bucket do not depend on the data-parallel size (the buffer
layout pads in multiples of 64 from a 128-aligned bucket start, distributed/buffer_layout.py), so the state
reloads at another DP size, but not under another TP / PP layout or other buckets (--ddp-bucket-size,
--overlap-grad-reduce), as in Megatron-LM: `check_buckets` says which.
"""

from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.optimizer.distrib_optimizer_state import STATE_KEYS, fp8_param_gather_note, owned_state

DP_RESHARDABLE = "dp_reshardable"


def _group_prefix(sub, prefix: str) -> str:
    """Megatron-Core's prefix of `sub`'s keys: its rank in the model-parallel group (TP x PP; for routed
    experts the expert-TP x EP x PP group), which tells apart the data-parallel groups that write."""
    model_parallel_rank = 0
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        experts = any(getattr(param, "allreduce", True) is False for param in sub.model_params)
        group = (parallel_state.get_expert_tensor_model_pipeline_parallel_group() if experts
                 else parallel_state.get_model_parallel_group())
        model_parallel_rank = dist.get_rank(group)
    return f"{prefix}optimizer.distributed.dp_group_idx_{model_parallel_rank}."


def _dtypes(buffer) -> str:
    return str((buffer.param_dtype, buffer.grad_dtype))


def bucket_numels(sub, padded: bool) -> List[Dict[tuple, List[int]]]:
    """Per buffer, {(param dtype, grad dtype): [numel of each bucket]} (padded or unpadded)."""
    return [{(buffer.param_dtype, buffer.grad_dtype): [bucket.grad_data.numel() if padded else bucket.numel_unpadded
                                                       for bucket in buffer.buckets]}
            for buffer in sub.buffers]


def _local_bucket_state(sub, bucket, fill: bool) -> torch.Tensor:
    """[len(STATE_KEYS), S]: this rank's shard of `bucket` for each state name (filled from the optimizer,
    or zeros to load into)."""
    size = dist.get_world_size(sub.data_parallel_group)
    local = torch.zeros(len(STATE_KEYS), bucket.grad_data.numel() // size, device=bucket.grad_data.device)
    if fill:
        for piece, row, tensor in owned_state(sub, bucket):
            if tensor is not None:
                local[row, piece.local_start : piece.local_end] = tensor.detach()
    return local


def bucket_sharded_state_dict(sub, prefix: str = "", fill: bool = True) -> dict:
    """The entry of one distributed optimizer `sub` (see the module docstring); `prefix` is Megatron's
    `chained_{i}.` when there are several. With fill=False (a load request) the tensors are zeros that
    `apply_bucket_state` then copies into the optimizer."""
    group_prefix = _group_prefix(sub, prefix)
    rank = dist.get_rank(sub.data_parallel_group)
    param_state = {}
    for buffer_index, buffer in enumerate(sub.buffers):
        buckets = []
        for bucket_index, bucket in enumerate(buffer.buckets):
            local = _local_bucket_state(sub, bucket, fill)
            start = rank * local.shape[1]
            length = max(0, min(local.shape[1], bucket.numel_unpadded - start))
            key = f"{group_prefix}gbuf_idx_{buffer_index}.dtype_{_dtypes(buffer)}.bucket_idx_{bucket_index}"
            buckets.append({name: ShardedTensor(f"{key}.{name}", local[row, :length], (bucket.numel_unpadded,),
                                                (start,)) for row, name in enumerate(STATE_KEYS) if length > 0})
        param_state[buffer_index] = {(buffer.param_dtype, buffer.grad_dtype): buckets}
    replica_id = (0, 0, rank)
    for name, padded in (("per_bucket_numel", True), ("per_bucket_numel_unpadded", False)):
        param_state[name] = ShardedObject(f"{group_prefix}{name}", bucket_numels(sub, padded), (1,), (0,), replica_id)
    common = {key: value if fill else None for key, value in sub.state_dict().items()}
    entry = {key: ShardedObject(f"{group_prefix}{key}", value, (1,), (0,), replica_id) for key, value in common.items()}
    return {**entry, "param_state": param_state, "param_state_sharding_type": DP_RESHARDABLE}


def apply_bucket_state(sub, entry: dict) -> None:
    """Copies a loaded `bucket_sharded_state_dict(..., fill=False)` into `sub`'s main shards and Adam state
    (`sub.load_state_dict` must have allocated the Adam state)."""
    for buffer_index, buffer in enumerate(sub.buffers):
        buckets = entry["param_state"][buffer_index][(buffer.param_dtype, buffer.grad_dtype)]
        for bucket, loaded in zip(buffer.buckets, buckets):
            for piece, row, tensor in owned_state(sub, bucket):
                if tensor is None:
                    raise RuntimeError("load the optimizer's state_dict (load_state_dict) before its param state")
                tensor.detach().copy_(loaded[STATE_KEYS[row]].data[piece.local_start : piece.local_end])


def check_buckets(sub, saved_shapes: Dict[str, tuple], prefix: str = "") -> None:
    """Raises a ValueError naming the difference when the checkpoint's buckets (global shapes from its
    metadata) are not `sub`'s."""
    group_prefix = _group_prefix(sub, prefix)
    for buffer_index, buffer in enumerate(sub.buffers):
        for bucket_index, bucket in enumerate(buffer.buckets):
            key = f"{group_prefix}gbuf_idx_{buffer_index}.dtype_{_dtypes(buffer)}.bucket_idx_{bucket_index}.param"
            saved = saved_shapes.get(key)
            if saved != (bucket.numel_unpadded,):
                found = sorted(name for name in saved_shapes
                               if name.startswith(group_prefix) and name.endswith(".param"))
                saved_uint8 = [torch.uint8] if any(".dtype_(torch.uint8," in name for name in found) else []
                raise ValueError(
                    f"the checkpoint's distributed-optimizer state (layout dp_reshardable) does not fit this run: "
                    f"{key} should hold {bucket.numel_unpadded} elements, the checkpoint has "
                    f"{'no such tensor' if saved is None else saved} (its buckets: {found or 'none'}). That layout "
                    "reloads only under the saving run's tensor/pipeline-parallel sizes, precision and buckets "
                    "(--ddp-bucket-size, --overlap-grad-reduce); save with --dist-ckpt-optim-fully-reshardable to "
                    "reshard, or pass --no-load-optim." + fp8_param_gather_note(saved_uint8, sub)
                )
