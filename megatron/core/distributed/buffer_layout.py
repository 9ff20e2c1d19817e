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
bucket_size means one bucket. Given each param's transformer layer (`param_layers`, None outside the
layers), a bucket that reached bucket_size closes only where the next param laid out is of another layer:
buckets hold whole layers (Megatron-FSDP's units), so a bucket's gradients are all produced within the
backward of its layers. `numel_unpadded` of a bucket runs from its start to the end of its last
param (for a bucket closed early by a shared embedding, to that param's 64-aligned start, as Megatron
counts it); `distrib_optim.pt` concatenates exactly these unpadded stretches.

Data-parallel rank r owns the r-th of the dp equal shards of every bucket (`owned_ranges`: the pieces of
the params that fall in it). Two buffers of the same param shapes in the same order (the TP ranks' copies
of a stage) thus shard every param alike, and a shared embedding, alone in its bucket at its start, is
sharded alike on both stages whatever else they hold.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

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
    param_layers: Optional[Sequence[Optional[int]]] = None,
) -> BufferLayout:
    """The layout of params with `param_numels` (module order); see the module docstring for the rules.

    `needs_own_bucket[i]` marks params that get a bucket of their own (only under the distributed optimizer).
    `param_layers[i]`: the transformer layer of param i (None outside the layers); buckets then close only
    between layers.
    """
    needs_own_bucket = needs_own_bucket or [False] * len(param_numels)
    param_layers = param_layers or [None] * len(param_numels)
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
        # The next param laid out is index - 1: a bucket may close before it unless it is of the same layer.
        layer = param_layers[index]
        mid_layer = layer is not None and index > 0 and param_layers[index - 1] == layer
        if (bucket_size is not None and end - bucket_start >= bucket_size and not mid_layer) or own_bucket:
            next_start = close_bucket(end)
        else:
            next_start = end
    if bucket_params:
        close_bucket(next_start)
    return BufferLayout(param_ranges, buckets)


def owned_ranges(
    param_buffer_ranges: Dict[object, Tuple[int, int]],
    bucket_start: int,
    bucket_end: int,
    data_parallel_rank: int,
    data_parallel_size: int,
) -> Dict[object, Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]]:
    """For the params of one bucket (their [start, end) in the buffer), the pieces that `data_parallel_rank`
    owns: {param: ((buffer start, end), (start, end) in the rank's shard, (start, end) in the param)}.

    The shard of rank r is [bucket_start + r*S, bucket_start + (r+1)*S), S = (bucket_end - bucket_start) / dp.
    """
    shard_size = (bucket_end - bucket_start) // data_parallel_size
    shard_start = bucket_start + data_parallel_rank * shard_size
    shard_end = shard_start + shard_size
    pieces = {}
    for param, (start, end) in param_buffer_ranges.items():
        piece_start, piece_end = max(start, shard_start), min(end, shard_end)
        if piece_end > piece_start:
            pieces[param] = (
                (piece_start, piece_end),
                (piece_start - shard_start, piece_end - shard_start),
                (piece_start - start, piece_end - start),
            )
    return pieces
