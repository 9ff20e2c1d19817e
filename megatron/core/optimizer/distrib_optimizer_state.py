"""The distributed optimizer's sharded state, gathered on data-parallel rank 0 in Megatron's layout
(`distrib_optim.pt` of torch-format checkpoints, "dp_zero_gather_scatter"):

    {"buckets_coalesced": True,
     buffer index: {(param dtype, grad dtype): {"param":      fp32 [N]    main params
                                                "exp_avg":    fp32 [N]    Adam's first moment
                                                "exp_avg_sq": fp32 [N]    Adam's second moment
                                                "numel_unpadded": N}}}

Each tensor is the buffer's buckets, each cut to its unpadded stretch (see distributed/buffer_layout.py),
concatenated: element i of bucket b sits at numel_unpadded(0) + ... + numel_unpadded(b-1) + i, and the
64-element gaps between params inside a bucket stay (as zeros). Offsets inside a bucket do not depend on
the data-parallel size (the padding is in multiples of 64 from a 128-aligned bucket start), so a state
gathered at one DP size scatters onto another, provided the buckets are the same (same
--ddp-bucket-size and --overlap-grad-reduce); the element counts are checked.

Per bucket, every rank copies the pieces it owns into a [3, S] fp32 tensor (its shard of the bucket), rank 0
gathers them (S x dp = padded bucket) and keeps the unpadded stretch; loading reverses this with a
scatter. Moments kept in bf16 (--exp-avg-dtype / --exp-avg-sq-dtype bf16) are widened to fp32 on the way out
and rounded to nearest on the way in, as Megatron-LM's precision-aware optimizer does: the file is the same
for either setting, and loads into either. The collectives use the gloo twin of the data-parallel group on the
CPU when there is one.
"""

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("param",) + ADAM_STATE_KEYS


def _communication(optimizer) -> Tuple[dist.ProcessGroup, torch.device]:
    """The group to gather over and the device its tensors must be on."""
    group = optimizer.data_parallel_group_gloo or optimizer.data_parallel_group
    if dist.get_backend(group) == "gloo":
        return group, torch.device("cpu")
    return group, torch.device("cuda", torch.cuda.current_device())


def _params_device(optimizer) -> torch.device:
    return optimizer.buffers[0].grad_data.device


def owned_state(optimizer, bucket) -> Iterator[Tuple[object, int, Optional[torch.Tensor]]]:
    """(this rank's piece of a param, row of STATE_KEYS, that row's tensor) for the params of `bucket`."""
    for param in bucket.params_list:
        piece = optimizer.shard_ranges.get(param)
        if piece is not None:
            tensors = optimizer.main_param_and_state(param)
            for row, key in enumerate(STATE_KEYS):
                yield piece, row, tensors[key]


def gather_parameter_state_dp_zero(optimizer) -> Optional[dict]:
    """All ranks' main params and Adam moments of `optimizer` (a DistributedOptimizer) on data-parallel
    rank 0, in the layout above; None on the other ranks. Entries of Adam moments that do not exist yet
    (before the first step) are zeros, which is what Adam starts from."""
    group, device = _communication(optimizer)
    rank, size, root = dist.get_rank(group), dist.get_world_size(group), dist.get_global_rank(group, 0)
    state = {"buckets_coalesced": True}
    for buffer_index, buffer in enumerate(optimizer.buffers):
        world = torch.zeros(len(STATE_KEYS), buffer.numel_unpadded, dtype=torch.float32) if rank == 0 else None
        offset = 0
        for bucket in buffer.buckets:
            local = torch.zeros(len(STATE_KEYS), bucket.grad_data.numel() // size, device=_params_device(optimizer))
            for piece, row, tensor in owned_state(optimizer, bucket):
                if tensor is not None:
                    local[row, piece.local_start : piece.local_end] = tensor.detach()
            local = local.to(device)
            received = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
            dist.gather(local, received, dst=root, group=group)
            if rank == 0:
                bucket_state = torch.cat(received, dim=1)[:, : bucket.numel_unpadded]  # [3, unpadded]
                world[:, offset : offset + bucket.numel_unpadded] = bucket_state.cpu()
            offset += bucket.numel_unpadded
        if rank == 0:
            tensors = {key: world[row] for row, key in enumerate(STATE_KEYS)}
            state[buffer_index] = {(buffer.param_dtype, buffer.grad_dtype): {**tensors, "numel_unpadded": offset}}
    return state if rank == 0 else None


def fp8_param_gather_note(saved_param_dtypes, optimizer) -> str:
    """A sentence naming --fp8-param-gather when the checkpoint (buffers of `saved_param_dtypes`) and this run
    differ in it: weights stored in FP8 have uint8 buffers of their own, which moves every bucket; else ""."""
    saved = torch.uint8 in set(saved_param_dtypes)
    here = any(buffer.param_dtype == torch.uint8 for buffer in optimizer.buffers)
    if saved == here:
        return ""
    return (f" The checkpoint was saved {'with' if saved else 'without'} --fp8-param-gather, this run is "
            f"{'with' if here else 'without'} it (weights stored in FP8 have buffers of their own): resume with the "
            "same setting, or pass --no-load-optim, or save with --ckpt-format torch_dist "
            "--dist-ckpt-optim-fully-reshardable, whose optimizer state loads either way.")


def _buffer_states(optimizer, state_dict) -> Tuple[Optional[List[dict]], Optional[str]]:
    """(per-buffer {"param", "exp_avg", "exp_avg_sq"} dicts, None) or (None, what does not fit)."""
    if not isinstance(state_dict, dict):
        return None, f"expected a dict of per-buffer states, got {type(state_dict).__name__}"
    buffer_keys = sorted(key for key in state_dict if isinstance(key, int))
    saved_param_dtypes = [dtypes[0] for key in buffer_keys if isinstance(state_dict[key], dict)
                          for dtypes in state_dict[key] if isinstance(dtypes, tuple)]
    note = fp8_param_gather_note(saved_param_dtypes, optimizer)
    if buffer_keys != list(range(len(optimizer.buffers))) or note:
        return None, (
            f"it holds the state of {len(buffer_keys)} parameter buffer(s), this model has {len(optimizer.buffers)} "
            f"(different precision settings, or expert-parallel params?).{note}"
        )
    states = []
    for index, buffer in enumerate(optimizer.buffers):
        entries = list(state_dict[index].values())
        if len(entries) != 1 or any(key not in entries[0] for key in STATE_KEYS):
            return None, f"buffer {index} must hold one entry with {', '.join(STATE_KEYS)}"
        saved_numel = entries[0]["param"].numel()
        if saved_numel != buffer.numel_unpadded:
            return None, (
                f"buffer {index} ({buffer.param_dtype} params) holds {saved_numel} elements, this run's has "
                f"{buffer.numel_unpadded}: another model, or other buckets (--ddp-bucket-size, --overlap-grad-reduce)"
            )
        states.append(entries[0])
    return states, None


def scatter_parameter_state_dp_zero(optimizer, state_dict: Optional[dict]) -> None:
    """Loads `gather_parameter_state_dp_zero` output (on data-parallel rank 0; None elsewhere) into every
    rank's main shards and Adam moments (which `load_state_dict` must have allocated)."""
    group, device = _communication(optimizer)
    rank, size, root = dist.get_rank(group), dist.get_world_size(group), dist.get_global_rank(group, 0)
    states, problem = _buffer_states(optimizer, state_dict) if rank == 0 else (None, None)
    # Rank 0 alone can judge the file; every rank must raise, or the others would wait in the scatter forever.
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=root, group=group)
    if verdict[0] is not None:
        raise ValueError(f"the distributed optimizer state does not fit this run: {verdict[0]}")
    for buffer_index, buffer in enumerate(optimizer.buffers):
        offset = 0
        for bucket in buffer.buckets:
            numel, unpadded = bucket.grad_data.numel(), bucket.numel_unpadded
            received = torch.empty(len(STATE_KEYS), numel // size, device=device)
            shards = None
            if rank == 0:
                saved = states[buffer_index]
                stretch = torch.stack([saved[key][offset : offset + unpadded].float() for key in STATE_KEYS])
                padded = F.pad(stretch, (0, numel - unpadded)).to(device)  # [3, numel]
                shards = [shard.contiguous() for shard in padded.split(numel // size, dim=1)]
            dist.scatter(received, shards, src=root, group=group)
            received = received.to(_params_device(optimizer))
            for piece, row, tensor in owned_state(optimizer, bucket):
                if tensor is None:
                    raise RuntimeError("load the optimizer's state_dict (load_state_dict) before its param state")
                tensor.detach().copy_(received[row, piece.local_start : piece.local_end])
            offset += unpadded
