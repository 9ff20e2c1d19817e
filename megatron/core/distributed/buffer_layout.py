"""Where each parameter lives in a flat gradient (and parameter) buffer, and where the buckets are cut.

Params are laid out back to front, roughly the order backward produces their gradients:

    plain DDP               [ p_n | p_n-1 | ... | p_1 ]                      no padding
    distributed optimizer   [ p_n |.| p_n-1 |.| ... | p_1 |...]              '.': padding

With the distributed optimizer (Megatron's rules, so that `distrib_optim.pt` files line up):
  * every param starts at a multiple of 64 elements (128-byte aligned for 16-bit types);
  * every bucket ends at a multiple of lcm(dp, 128), so it cuts into dp equal shards, each 128-aligned;
  * a param marked `shared_embedding` (the tied word embedding that lives on the first and the last
    pipeline stage) gets a bucket of its own, so both stages shard it the same way.

A bucket closes once it spans >= bucket_size elements counted from its start (padding included); no
bucket_size means one bucket. `numel_unpadded` of a bucket runs from its start to the end of its last
param (for a bucket closed early by a shared embedding, to that param's 64-aligned start, as Megatron
counts it); `distrib_optim.pt` concatenates exactly these unpadded stretches.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

PARAM_START_ALIGNMENT = 64
BUCKET_END_ALIGNMENT = 128


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class BucketRange:
    """Bucket `bucket_id` covers [start, end) of the buffer; its params are `param_indices` (back to front)."""

    bucket_id: int
    start: int
    end: int
    numel_unpadded: int
    param_indices: Tuple[int, ...]


@dataclass(frozen=True)
class BufferLayout:
    """`param_ranges[i]` = (start, end, bucket id) of param i (module order); `buckets` in buffer order."""

    param_ranges: List[Tuple[int, int, int]]
    buckets: List[BucketRange]

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(bucket.numel_unpadded for bucket in self.buckets)


def compute_buffer_layout(
    param_numels: Sequence[int],
    bucket_size: Optional[int],
    data_parallel_size: int,
    use_distributed_optimizer: bool,
    needs_own_bucket: Optional[Sequence[bool]] = None,
) -> BufferLayout:
    """The layout of params with `param_numels` (module order); see the module docstring for the rules.

    `needs_own_bucket[i]` marks params that get a bucket of their own (only under the distributed optimizer).
    """
    needs_own_bucket = needs_own_bucket or [False] * len(param_numels)
    bucket_end_alignment = math.lcm(data_parallel_size, BUCKET_END_ALIGNMENT)

    def pad_param_start(index: int) -> int:
        return _round_up(index, PARAM_START_ALIGNMENT) if use_distributed_optimizer else index

    def pad_bucket_end(index: int) -> int:
        return _round_up(index, bucket_end_alignment) if use_distributed_optimizer else index

    param_ranges: List[Optional[Tuple[int, int, int]]] = [None] * len(param_numels)
    buckets: List[BucketRange] = []
    bucket_start, bucket_params = 0, []

    def close_bucket(unpadded_end: int) -> int:
        nonlocal bucket_start, bucket_params
        end = pad_bucket_end(unpadded_end)
        buckets.append(BucketRange(len(buckets), bucket_start, end, unpadded_end - bucket_start, tuple(bucket_params)))
        bucket_start, bucket_params = end, []
        return end

    next_start = 0
    for index in reversed(range(len(param_numels))):
        own_bucket = use_distributed_optimizer and needs_own_bucket[index]
        start = pad_param_start(next_start)
        if own_bucket and bucket_params:
            start = close_bucket(start)
        end = start + param_numels[index]
        param_ranges[index] = (start, end, len(buckets))
        bucket_params.append(index)
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            next_start = close_bucket(end)
        else:
            next_start = end
    if bucket_params:
        close_bucket(next_start)
    return BufferLayout(param_ranges, buckets)
