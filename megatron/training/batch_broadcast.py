"""Microbatches read on tensor-parallel rank 0 and broadcast to the rest of its TP group (Megatron's
`get_batch_on_this_tp_rank`).

Every rank of a TP group computes on the same microbatch, so only TP rank 0 builds the datasets and
reads them (`is_dataset_built_on_rank`); the other ranks hold no iterator and receive the tensors.

Per microbatch, two broadcasts from TP rank 0:

    header  int64 [1 + len(keys) * (2 + MAX_DIMS)], on the host, over the TP group's gloo twin
            [0]                        status: BATCH follows, EXHAUSTED iterator, or REFUSED batch
            per key: dtype code (-1 = absent), ndim, shape padded with zeros to MAX_DIMS
    payload uint8 [sum of the tensors' byte sizes, each rounded up to ALIGNMENT], on the device
            rank 0 copies each tensor into its slot (host-to-device copies, asynchronous from the data
            loader's pinned memory); every rank then views the slots as the tensors

The header goes host to host (core/tensor_parallel/host_group.py): no rank reads a device value, so the
host keeps queueing work ahead of the GPU, and the batch is never packed on the CPU. It still comes with
every microbatch because only TP rank 0 can know what the next one is, and the rare cases need it: an
exhausted iterator (every rank raises StopIteration instead of leaving TP ranks 1.. waiting in a
collective that never comes), a short last validation batch (other shapes), a key the dataset did not
produce (an absent attention mask), and a batch that cannot be sent (a ValueError on every rank).
Megatron instead derives the shapes from --micro-batch-size/--seq-length and handles none of these.
"""

from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.host_group import broadcast_on_host

GPT_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
MAX_DIMS = 4  # the attention mask is [b, 1, s, s]
ALIGNMENT = 16  # bytes: every tensor starts on a boundary that any dtype may be viewed from
_DTYPES = (
    torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool,
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
)
_SLOTS_PER_KEY = 2 + MAX_DIMS
EXHAUSTED, BATCH, REFUSED = 0, 1, 2


def batch_device() -> torch.device:
    """Where batches go: the current GPU when there is one (NCCL broadcasts need it there), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


def _problem(key: str, value) -> Optional[str]:
    """Why batch[key] cannot be broadcast, or None."""
    if torch.is_tensor(value) and value.dtype in _DTYPES and value.dim() <= MAX_DIMS:
        return None
    return (
        f"batch[{key!r}] cannot be broadcast over the tensor-parallel group: expected a tensor of at most "
        f"{MAX_DIMS} dims with a dtype in {', '.join(map(str, _DTYPES))}, got {type(value).__name__} "
        f"{getattr(value, 'dtype', '')} {tuple(getattr(value, 'shape', ()))}"
    )


def _encode_header(batch: Optional[dict], keys: Sequence[str]) -> tuple[torch.Tensor, list[str]]:
    """(header, problems): the header of `batch` (None: exhausted), or a REFUSED one with the reasons."""
    header = torch.zeros(1 + len(keys) * _SLOTS_PER_KEY, dtype=torch.int64)
    if batch is None:
        header[0] = EXHAUSTED
        return header, []
    problems = [problem for key in keys if batch.get(key) is not None and (problem := _problem(key, batch[key]))]
    if problems:
        header[0] = REFUSED
        return header, problems
    header[0] = BATCH
    for index, key in enumerate(keys):
        slots = header[1 + index * _SLOTS_PER_KEY : 1 + (index + 1) * _SLOTS_PER_KEY]
        value = batch.get(key)
        if value is None:
            slots[0] = -1
            continue
        slots[0] = _DTYPES.index(value.dtype)
        slots[1] = value.dim()
        slots[2 : 2 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
    return header, []


def _decode_header(header: list[int], keys: Sequence[str]) -> dict:
    """{key: (dtype, shape) or None} from the header's values."""
    layout = {}
    for index, key in enumerate(keys):
        code, ndim, *dims = header[1 + index * _SLOTS_PER_KEY : 1 + (index + 1) * _SLOTS_PER_KEY]
        layout[key] = None if code < 0 else (_DTYPES[code], tuple(dims[:ndim]))
    return layout


def _byte_size(dtype: torch.dtype, shape: tuple) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _slots(payload: torch.Tensor, layout: dict) -> dict:
    """{key: the view of `payload` that holds that tensor, or None for an absent key}."""
    batch, offset = {}, 0
    for key, entry in layout.items():
        if entry is None:
            batch[key] = None
            continue
        dtype, shape = entry
        size = _byte_size(dtype, shape)
        batch[key] = payload[offset : offset + size].view(dtype).view(shape)
        offset += _aligned(size)
    return batch


def _is_source(tp_group) -> bool:
    """Whether this rank is rank 0 of `tp_group` (None: a process without tensor-parallel peers)."""
    return tp_group is None or dist.get_rank(tp_group) == 0


def broadcast_batch(batch: Optional[dict], keys: Sequence[str] = GPT_BATCH_KEYS, *, tp_group) -> dict:
    """`batch` (given on rank 0 of `tp_group`, ignored elsewhere) on every rank of the tensor-parallel group
    `tp_group`, on `batch_device()`; `tp_group` None: this process alone (torch.distributed not initialised).

    Returns {key: tensor, or None where the batch lacks the key}. `batch=None` on TP rank 0 means there
    is no further batch: every rank of the group then raises StopIteration. Collective over the TP group.
    """
    device = batch_device()
    is_source = _is_source(tp_group)
    header, problems = _encode_header(batch if is_source else None, keys)
    tensor_parallel = tp_group is not None and dist.get_world_size(tp_group) > 1
    if tensor_parallel:
        broadcast_on_host(header, tp_group)
    header = header.tolist()  # a CPU tensor: no device sync
    if header[0] == EXHAUSTED:
        raise StopIteration
    if header[0] == REFUSED:
        raise ValueError("; ".join(problems) or "tensor-parallel rank 0 could not broadcast its batch (see its error)")
    layout = _decode_header(header, keys)
    if not tensor_parallel:
        return {key: None if entry is None else batch[key].to(device, non_blocking=True) for key, entry in layout.items()}
    total = sum(_aligned(_byte_size(*entry)) for entry in layout.values() if entry is not None)
    payload = torch.empty(total, dtype=torch.uint8, device=device)
    received = _slots(payload, layout)
    if is_source:
        for key, slot in received.items():
            if slot is not None:
                slot.copy_(batch[key], non_blocking=True)
    dist.broadcast(payload, group=tp_group, group_src=0)
    return received


def get_batch_on_this_tp_rank(data_iterator: Optional[Iterator], keys: Sequence[str] = GPT_BATCH_KEYS, *,
                              tp_group) -> dict:
    """The next microbatch of `data_iterator` on every rank of the tensor-parallel group `tp_group` (Megatron's
    name; Megatron-LM main's entry scripts likewise pass the group, as `broadcast_group`).

    Only TP rank 0 reads the iterator (the other ranks may pass None). An exhausted iterator raises
    StopIteration on every rank of the group.
    """
    batch = None
    if _is_source(tp_group) and data_iterator is not None:
        batch = next(data_iterator, None)
    return broadcast_batch(batch, keys, tp_group=tp_group)
