"""`ShardedGradDataParallel`: Megatron-FSDP's `optim_grads` strategy (ZeRO-2) on DDP's buffers and buckets.

As with the distributed optimizer, the bf16 (or fp32) params live whole in one flat param buffer, each rank owns
one shard of every bucket and keeps the fp32 main params and Adam moments of that shard only. What differs is
the gradient: instead of a whole grad buffer kept over all microbatches, each rank keeps only its fp32 shard,

    grad_shard of bucket b on rank r  +=  rows of r of  scaling x sum over ranks q of g_q(b)

once per microbatch: a bucket's gradient storage (the size of the bucket, in the reduce dtype) exists only from
the backward of the bucket's first layer until its reduce-scatter has completed. Per rank that is

    persistent   2 (bf16 param) + 4/dp (fp32 grad shard) + 12/dp (main param + moments) bytes per param
    transient    one to three buckets' gradients during backward (the bucket being filled, the reduce-scatters
                 in flight: one is kept in flight, an older one is waited for and freed)

instead of the distributed optimizer's 2 + 4 + 12/dp.

How a bucket's storage comes and goes: its `grad_data` tensor and every param's `main_grad` view of it are
made once; releasing resizes the storage under them to zero bytes, materialising resizes it back (the padding
zeroed, each param marked empty for its first writer: distributed_data_parallel.py), so
the views stay valid (and gradient-accumulation fusion keeps seeing an fp32 `main_grad` in forward). It is
materialised when backward first needs it: by the gradient hook of a param, or, before a fused weight-gradient
GEMM writes `main_grad` directly, by a hook on the gradient of the outputs of the transformer layer (or of the
whole model, for the params outside the layers) that holds the bucket's params. Buckets are cut by size as
DDP's are (bucket_size, by default max(4e7, 1e6 x dp) elements: about one layer of a 1B model), on every
pipeline stage, but only between transformer layers (buffer_layout.py): a bucket holds whole layers, so its
storage lives only from the backward of its last layer to that of its first.

Every bucket is reduce-scattered once per backward on every rank: a bucket launches when its last param got its
gradient, and the end of backward launches the rest (params that got none add zeros), then waits for all, so
no gradient storage outlives a backward. `no_sync` therefore holds nothing back.
"""

from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ... import parallel_state
from ..distributed_data_parallel import DistributedDataParallel, _accumulate_into_main_grad
from ..param_and_grad_bucket import _ParamAndGradBucket, _reduce_scatter_tensor
from ..param_and_grad_buffer import _ParamAndGradBuffer
from ...transformer.transformer_layer import TransformerLayer


def _transformer_layers(module: torch.nn.Module) -> List[TransformerLayer]:
    return [layer for layer in module.modules() if isinstance(layer, TransformerLayer)]


def _refuse_position_embeddings_across_stages(module: torch.nn.Module) -> None:
    """Position embeddings on several pipeline stages (a custom position-embedding group) are summed over
    them, which needs each stage's piece of them in the same place; only the tied word embedding is laid out
    so (a bucket of its own)."""
    if not parallel_state.is_rank_in_position_embedding_group():
        return
    if dist.get_world_size(parallel_state.get_position_embedding_group()) == 1:
        return
    if any(name.endswith("position_embeddings.weight") for name, _ in module.named_parameters()):
        raise ValueError(
            "--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads: position embeddings held by "
            "several pipeline stages are not supported yet (a position-embedding group of more than one "
            "rank, from get_position_embedding_ranks); use --data-parallel-sharding-strategy optim or "
            "optim_grads_params"
        )


class _ShardedGradBucket(_ParamAndGradBucket):
    """A bucket whose full-size gradient (`grad_data`, in the reduce dtype) is transient and whose reduced
    shard accumulates into the persistent fp32 `grad_shard`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._storage_bytes = self.grad_data.untyped_storage().nbytes()
        self._padding = self._padding_index()
        self.grad_shard = torch.zeros(self.grad_data.numel() // self.data_parallel_world_size, dtype=torch.float32,
                                      device=self.grad_data.device)
        self._reduced: Optional[torch.Tensor] = None  # the reduce-scatter's output while in flight
        # Until the step's first reduction has landed, grad_shard holds nothing: that reduction writes it
        # directly (no zeroing, no separate output, no addition), or is copied in (a bf16 reduction).
        self._shard_empty = True
        # Whether this backward has launched the bucket's reduce-scatter: a bucket finished (and freed) while
        # the backward runs must not be reduced again by the end of backward's flush.
        self.reduced_this_backward = False
        self.release()

    def _padding_index(self) -> torch.Tensor:
        """The elements of the bucket that belong to no param (alignment gaps and the end), as indices."""
        gaps, position, numel = [], 0, self.grad_data.numel()
        for start, end in sorted(self.param_to_index.values()) + [(numel, numel)]:
            if start > position:
                gaps.append(torch.arange(position, start))
            position = max(position, end)
        index = torch.cat(gaps) if gaps else torch.empty(0, dtype=torch.long)
        return index.to(self.grad_data.device)

    @property
    def materialized(self) -> bool:
        return self.grad_data.untyped_storage().nbytes() > 0

    def materialize(self) -> None:
        """Gives the gradient storage its bytes back (a no-op while it has them): the padding between params
        zeroed, each param marked `overwrite_main_grad` (its first writer writes: no pass zeroing the bucket)."""
        if not self.materialized:
            self.grad_data.untyped_storage().resize_(self._storage_bytes)
            if self._padding.numel():
                self.grad_data.index_fill_(0, self._padding, 0)
            for param in self.params_list:
                param.overwrite_main_grad = True

    def release(self) -> None:
        self.grad_data.untyped_storage().resize_(0)

    def register_grad_ready(self, param: torch.nn.Parameter, name: str) -> bool:
        """Notes `param`'s gradient of this backward; True when that completed the bucket (then launched)."""
        if self.reduced_this_backward:
            raise RuntimeError(f"{name} got a gradient after its bucket was reduce-scattered in this backward "
                               "(a param whose gradient hook runs twice in one backward is not supported)")
        self.params_with_grad.add(param)
        if len(self.params_with_grad) < len(self.params):
            return False
        self.start_grad_sync(async_op=True)
        return True

    def start_grad_sync(self, async_op: bool) -> None:
        """Scales the bucket's gradient and launches its reduce-scatter: into `grad_shard` itself for the
        step's first, else into a fresh shard-sized tensor that finish_grad_sync adds."""
        self.materialize()
        self.zero_unwritten_grads()
        if self.ddp_config.check_for_nan_in_grad:
            norm = self.grad_data.norm(p=2)
            self.local_grad_norm = norm if self.local_grad_norm is None else torch.maximum(self.local_grad_norm, norm)
        if self.gradient_scaling_factor != 1.0 and not self.scales_in_collective:
            self.grad_data *= self.gradient_scaling_factor
        self.grad_reduce_started = self.reduced_this_backward = True
        if self.data_parallel_world_size == 1:
            self._reduced, self.grad_reduce_handle = self.grad_data, None
            return
        into_shard = self._shard_empty and self.grad_shard.dtype == self.grad_data.dtype  # not a bf16 reduce
        self._reduced = self.grad_shard if into_shard else torch.empty_like(self.grad_shard,
                                                                            dtype=self.grad_data.dtype)
        handle = _reduce_scatter_tensor(self._reduced, self.grad_data, op=self._reduce_op,
                                        group=self.data_parallel_group, async_op=async_op)
        self.grad_reduce_handle = handle if async_op else None

    def finish_grad_sync(self) -> None:
        """Waits for the reduce-scatter in flight, adds its shard into `grad_shard` (unless it wrote it), frees
        the gradient storage."""
        if not self.grad_reduce_started:
            return
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        if self._divide_after_reduce:
            self._reduced /= self.data_parallel_world_size
        if self._reduced is not self.grad_shard:
            if self._shard_empty:
                self.grad_shard.copy_(self._reduced)
            else:
                self.grad_shard += self._reduced
        self._shard_empty = False
        self._reduced = None
        self.release()
        self.grad_reduce_started = False
        self.params_with_grad = set()

    def reset(self) -> None:
        """A new step: no reduction in flight, an empty gradient shard (module docstring)."""
        self.finish_grad_sync()
        self._shard_empty = True
        self.reduced_this_backward = False
        self.local_grad_norm = None

    def complete_shard(self) -> None:
        """Zeroes a shard no reduction wrote this step (none ran: no backward reached the bucket)."""
        if self._shard_empty:
            self.grad_shard.zero_()
            self._shard_empty = False


class _ShardedGradBuffer(_ParamAndGradBuffer):
    """DDP's buffer with the distributed optimizer's layout, each bucket's gradient in storage of its own
    (transient, see the module docstring); `grad_data` is None."""

    bucket_class = _ShardedGradBucket

    def __init__(self, *args, **kwargs):
        self._in_flight: List[_ShardedGradBucket] = []
        super().__init__(*args, **kwargs)

    def _allocate_grads(self, layout, device: torch.device) -> List[torch.Tensor]:
        self.grad_data = None
        return [torch.zeros(bucket.end - bucket.start, dtype=self.grad_dtype, device=device)
                for bucket in layout.buckets]

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """After `param`'s gradient hook: launches its bucket once complete, keeping one older reduce-scatter
        in flight at most (the oldest is waited for and its storage freed)."""
        bucket = self.param_to_bucket[param]
        if bucket.register_grad_ready(param, self.param_to_name[param]):
            self._in_flight.append(bucket)
            while len(self._in_flight) > 2:
                self._in_flight.pop(0).finish_grad_sync()

    def flush(self) -> None:
        """End of a backward: reduces every bucket this backward has not launched yet and waits for all."""
        for bucket in self.buckets:
            if not bucket.reduced_this_backward:
                bucket.start_grad_sync(async_op=True)
        for bucket in self.buckets:
            bucket.finish_grad_sync()
            bucket.reduced_this_backward = False
        self._in_flight = []

    def scale_gradients(self, scaling_factor: float) -> None:
        torch._foreach_mul_([bucket.grad_shard for bucket in self.buckets], scaling_factor)

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._in_flight = []

    def start_grad_sync(self, async_op: bool) -> None:
        """The reductions run in every backward (`flush`); nothing is left for the end of the step."""

    def finish_grad_sync(self) -> None:
        """Completes what is in flight (normally nothing: each backward ends with `flush`), then checks the
        local gradients of the step for nan/inf."""
        for bucket in self.buckets:
            bucket.finish_grad_sync()
            bucket.complete_shard()
        self._in_flight = []
        if self.ddp_config.check_for_nan_in_grad and all(b.local_grad_norm is not None for b in self.buckets):
            self._check_local_grads_were_finite()


class ShardedGradDataParallel(DistributedDataParallel):
    """DDP with the distributed optimizer's layout whose gradients are sharded too (module docstring). Takes
    DDP's arguments; `ddp_config.use_distributed_optimizer` must be set (the optimizer owns the shards)."""

    buffer_class = _ShardedGradBuffer
    one_bucket_after_first_stage = False  # every stage keeps its gradients in buckets of ~bucket_size

    def __init__(self, config, ddp_config, module: torch.nn.Module, disable_bucketing: bool = False):
        if not (ddp_config.use_distributed_optimizer and ddp_config.overlap_grad_reduce):
            raise ValueError("ShardedGradDataParallel reduce-scatters each bucket during backward into the "
                             "distributed optimizer's shards: it needs use_distributed_optimizer and "
                             "overlap_grad_reduce in its DistributedDataParallelConfig")
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing)
        self._flush_queued = False
        self.param_to_buffer = {param: buffer for buffer in self._all_buffers for param in buffer.params}
        layers = _transformer_layers(module)
        inside = {param for layer in layers for param in layer.parameters()}
        self._module_buckets = {layer: self._buckets_of(layer.parameters()) for layer in layers}
        self._module_buckets[module] = self._buckets_of(param for param in module.parameters() if param not in inside)
        self._layer_hooks = [sub.register_forward_hook(self._materialize_before_backward)
                             for sub in self._module_buckets]
        self._grad_pieces = {param: piece for buffer in self._all_buffers
                             for param, piece in buffer.owned_grad_pieces().items()}
        _refuse_position_embeddings_across_stages(module)

    def _param_layers(self) -> Dict[torch.nn.Parameter, int]:
        """Buckets hold whole transformer layers (module docstring)."""
        return {param: index for index, layer in enumerate(_transformer_layers(self.module))
                for param in layer.parameters()}

    def _buckets_of(self, params) -> list:
        return list({self.param_to_bucket[param]: None for param in params if param in self.param_to_bucket})

    def _gradient_hook(self, param: torch.nn.Parameter) -> None:
        self.param_to_bucket[param].materialize()
        if not self._flush_queued:
            # Runs once this backward has finished (after every gradient hook).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._flush_queued = True
        _accumulate_into_main_grad(param)
        self.param_to_buffer[param].grad_ready(param)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        for buffer in self._all_buffers:
            buffer.flush()

    def _materialize_before_backward(self, module: torch.nn.Module, inputs, output) -> None:
        """Forward hook of a transformer layer (or of the whole model): once the gradient of its output exists,
        i.e. before its backward writes any `main_grad`, the buckets of its params get their storage. The whole
        model's hook covers the params outside the layers (embeddings, output layer, final norm)."""
        if not torch.is_grad_enabled():
            return
        outputs = [tensor for tensor in (output if isinstance(output, (tuple, list)) else (output,))
                   if torch.is_tensor(tensor) and tensor.requires_grad]
        buckets = self._module_buckets[module]
        if not outputs or not buckets:
            return

        def materialize(unused_grads):
            for bucket in buckets:
                bucket.materialize()

        torch.autograd.graph.register_multi_grad_hook(outputs, materialize, mode="any")

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's piece of `param`'s reduced gradient of the step: a flat view into its bucket's
        `grad_shard`, empty where the rank owns none of it (`main_grad` has no storage after a backward).

        finalize_model_grads sums these pieces over the TP ranks (sequence-parallel and q/k norms) and over the
        first and last pipeline stage (the tied embedding) in place. That is the piece of the summed gradient
        because every copy owns the same piece: the TP ranks' buffers hold the same param shapes in the same
        order, and the tied embedding has a bucket of its own on both stages (buffer_layout.py). Summing
        after the reduce-scatter is exact: both sums are linear."""
        return self._grad_pieces.get(param, self.param_to_bucket[param].grad_shard[:0])

    @contextmanager
    def no_sync(self):
        """Nothing to hold back: each backward reduce-scatters its gradients into the shards."""
        yield

    def main_grad_buffers(self) -> List[torch.Tensor]:
        """This rank's fp32 gradient shards (the reduced, accumulated gradients of the step)."""
        return [bucket.grad_shard for buffer in self._all_buffers for bucket in buffer.buckets]
