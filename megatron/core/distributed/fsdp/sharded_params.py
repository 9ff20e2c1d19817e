"""`ShardedParamDataParallel`: Megatron-FSDP's `optim_grads_params` strategy (ZeRO-3) on DDP's buffers and buckets.

It is `optim_grads` (sharded_grads.py: the distributed optimizer's layout, fp32 gradient shards reduce-scattered
bucket by bucket in every backward) with the params sharded as well. Each rank keeps persistently only

    param_shard of bucket b on rank r   rows of r of the bucket's param buffer (bf16 under --bf16), the all-gather's
                                        input, which the optimizer's main -> model copy writes

and the bucket's whole param storage (`param_data`, every param's `.data` a view of it) is transient: it gets its
bytes back by `all_gather_into_tensor(param_data, param_shard)` and gives them up by resizing the storage to zero
bytes, which keeps the views valid objects (as the gradient storage of sharded_grads.py). Per rank that is

    persistent   2/dp (bf16 param shard) + 4/dp (fp32 grad shard) + 12/dp (main param + moments) bytes per param
    transient    the params outside the transformer layers (kept gathered from forward to backward), about two
                 layer buckets of params (the one computing, the one prefetched; the last layer's from its forward
                 to its backward), and sharded_grads.py's gradient buckets in flight

Units and hooks. The transformer layers are the units (Megatron-FSDP's): buckets hold whole layers
(buffer_layout.py), so each layer's params lie in one bucket per buffer. The params outside the layers (word and
position embeddings, output layer, final norm: a small share) get a bucket each and form the root unit, the whole
model: gathered by its forward pre-hook, kept until their gradients are reduce-scattered (the output layer's early
in backward, the embedding's at its end). A unit's buckets are gathered

    forward     in its forward pre-hook (waiting); the next unit's gather is launched there (prefetch)
    backward    in the one hook on the gradient of its outputs that also gives its buckets their gradient storage
                (sharded_grads.py), before any of its backward runs; the previous unit's gather is launched there
    recompute   full recompute (non-reentrant checkpointing) runs the forward with gradients on, so the hooks
                above are registered as in any forward; the forward it recomputes inside backward (found by the
                autograd engine's graph task) finds its params gathered and neither releases nor registers

and released after the forward of the bucket's last layer (not that of the last layer with gradients on: its
backward comes next), after the forward of the whole model without gradients (evaluation), and as soon as the
bucket's reduce-scatter is launched, i.e. once every param in
it has its gradient, when no node of the graph reads them any more; the end of each backward launches (and so
releases) every bucket. Each microbatch thus gathers every bucket twice, as Megatron-FSDP; the data gathered stays
valid until the optimizer step, which releases every bucket (`start_param_sync`). Several microbatches in flight
(1F1B pipelining) need nothing more: each forward registers its own backward hooks.

--overlap-param-gather (on by default here, as Megatron-FSDP turns it on for this strategy) is the prefetch;
without it every gather is synchronous. `start_param_sync(force_sync=True)` (before a weight hash check, and the
`disable_forward_pre_hook(param_sync=True)` of evaluation without hooks) makes every param whole until the next
forward or backward releases it.

Checkpoints are written from the shards: each param's piece in `param_shard` is tagged `data_parallel_stretch`,
which model_sharding.py turns into flattened-range pieces of the same global tensors that DDP writes, so a torch_dist
checkpoint resumes exactly and reshards to and from DDP / TP layouts, and loading writes the shards in place.
"""

from typing import Dict, List

import torch
import torch.distributed as dist

from ..param_and_grad_bucket import _all_gather_into_tensor
from .sharded_grads import ShardedGradDataParallel, _ShardedGradBucket, _ShardedGradBuffer, _transformer_layers

STRATEGY_FLAGS = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward (a recomputed forward runs inside one)."""
    return torch._C._current_graph_task_id() != -1


class _ShardedParamBucket(_ShardedGradBucket):
    """A bucket whose param storage (`param_data`) is transient and whose persistent `param_shard` is this
    rank's rows of it (with one data-parallel rank the storage is the shard and stays)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._param_bytes = self.param_data.untyped_storage().nbytes()
        self._sharded = self.data_parallel_world_size > 1
        if self._sharded:
            self.param_shard = self.param_shard.clone()

    @property
    def params_gathered(self) -> bool:
        """Whether the storage holds the params (a gather in flight counts once waited for)."""
        return self.param_data.untyped_storage().nbytes() > 0

    def gather_params(self, async_op: bool) -> None:
        """Launches the all-gather of the shards into the bucket's storage, unless gathered or in flight."""
        if self.param_gather_handle is not None or self.params_gathered:
            return
        self.param_data.untyped_storage().resize_(self._param_bytes)
        handle = _all_gather_into_tensor(self.param_data, self.param_shard, group=self.data_parallel_group,
                                         async_op=async_op)
        self.param_gather_handle = handle if async_op else None

    def wait_params(self) -> None:
        """The params are whole once this returns (gathered now if nothing was in flight)."""
        self.gather_params(async_op=False)
        self.wait_param_gather()

    def release_params(self) -> None:
        if self._sharded:
            self.wait_param_gather()
            self.param_data.untyped_storage().resize_(0)

    def keep_own_rows(self) -> None:
        """Copies this rank's rows of the gathered params into `param_shard` (after they were written whole)."""
        if self._sharded:
            self.param_shard.copy_(self.param_data.view(self.data_parallel_world_size, -1)[
                dist.get_rank(self.data_parallel_group)])

    def start_grad_sync(self, async_op: bool) -> None:
        """Launches the reduce-scatter; every param of the bucket has its gradient, so its storage goes."""
        super().start_grad_sync(async_op)
        self.release_params()


class _ShardedParamBuffer(_ShardedGradBuffer):
    """sharded_grads.py's buffer with each bucket's params in storage of their own (module docstring);
    `param_data` is None. The params outside the transformer layers get a bucket each."""

    bucket_class = _ShardedParamBucket

    def _allocate_params(self, layout, device: torch.device) -> List[torch.Tensor]:
        return [torch.zeros(bucket.end - bucket.start, dtype=self.param_dtype, device=device)
                for bucket in layout.buckets]

    def _needs_own_bucket(self, param: torch.nn.Parameter, param_layers) -> bool:
        return super()._needs_own_bucket(param, param_layers) or (param_layers or {}).get(param) is None

    def start_param_sync(self) -> None:
        """After an optimizer step: the gathered params are stale; the next forward gathers the new shards."""
        for bucket in self.buckets:
            bucket.release_params()

    def complete_param_sync(self) -> None:
        """Makes every param whole now."""
        for bucket in self.buckets:
            bucket.gather_params(async_op=True)
        for bucket in self.buckets:
            bucket.wait_params()


class ShardedParamDataParallel(ShardedGradDataParallel):
    """ZeRO-3 on DDP's buffers (module docstring); takes ShardedGradDataParallel's arguments and config."""

    buffer_class = _ShardedParamBuffer
    saves_whole_params = False  # checkpoints are written from `param_shard` (module docstring)

    def __init__(self, config, ddp_config, module: torch.nn.Module, disable_bucketing: bool = False):
        unsupported = {"--fp8-param-gather": ddp_config.fp8_param_gather,
                       "--num-distributed-optimizer-instances > 1": ddp_config.num_distributed_optimizer_instances > 1}
        for flags, given in unsupported.items():
            if given:
                raise ValueError(f"{STRATEGY_FLAGS} with {flags} is not supported yet")
        super().__init__(config, ddp_config, module, disable_bucketing)
        self._hook_units_handles = []
        layers = _transformer_layers(module)
        self._forward_order = [module] + layers
        self._backward_order = [module] + layers[::-1]
        self._last_layer = layers[-1] if layers else None
        self._last_users: Dict[torch.nn.Module, list] = {}  # the unit after whose forward a bucket goes
        for unit in self._forward_order:
            for bucket in self._module_buckets[unit]:
                self._last_users[bucket] = unit
        self._releases = {unit: [] for unit in self._forward_order}
        for bucket, unit in self._last_users.items():
            self._releases[unit].append(bucket)
        for buffer in self._all_buffers:
            for param, (bucket, local, in_param) in buffer.owned_pieces().items():
                param.data_parallel_stretch = (bucket.param_shard[local[0] : local[1]], in_param[0])
            for param in buffer.params:
                if not hasattr(param, "data_parallel_stretch"):
                    param.data_parallel_stretch = (buffer.buckets[0].param_shard[:0], 0)
            for bucket in buffer.buckets:
                bucket.release_params()
        self.enable_forward_pre_hook()

    def _prefetch(self, order: List[torch.nn.Module], unit: torch.nn.Module) -> None:
        """Launches the gather of the unit after `unit` in `order` (not the root: it is gathered already)."""
        if not self.ddp_config.overlap_param_gather:
            return
        index = order.index(unit) + 1
        if index < len(order):
            for bucket in self._module_buckets[order[index]]:
                bucket.gather_params(async_op=True)

    def _gather(self, unit: torch.nn.Module, order: List[torch.nn.Module]) -> None:
        for bucket in self._module_buckets[unit]:
            bucket.wait_params()
        self._prefetch(order, unit)

    def _before_forward(self, unit: torch.nn.Module, *unused) -> None:
        self._gather(unit, self._backward_order if _in_backward() else self._forward_order)

    def _materialize_before_backward(self, unit: torch.nn.Module, inputs, output) -> None:
        """Forward hook of a unit (sharded_grads.py registers it): one hook on the gradient of its outputs gives
        the buckets their gradient storage and gathers their params before the unit's backward; then the
        buckets whose last unit this is are released (module docstring)."""
        if _in_backward() or not self._hook_units_handles:
            super()._materialize_before_backward(unit, inputs, output)
            return  # a recomputed forward (its backward follows at once), or the hooks are disabled
        outputs = [tensor for tensor in (output if isinstance(output, (tuple, list)) else (output,))
                   if torch.is_tensor(tensor) and tensor.requires_grad]
        if torch.is_grad_enabled() and outputs:
            def before_backward(unused_grads):
                for bucket in self._module_buckets[unit]:
                    bucket.materialize()
                self._gather(unit, self._backward_order)

            torch.autograd.graph.register_multi_grad_hook(outputs, before_backward, mode="any")
            if unit is self._last_layer or unit is self.module:
                return  # their backward comes next
            releases = self._releases[unit]
        else:
            releases = self._releases[unit] if unit is not self.module else list(self._last_users)
        for bucket in releases:
            bucket.release_params()

    def enable_forward_pre_hook(self) -> None:
        """Registers the units' pre-hooks that gather the params (their forward hooks, which release them, act
        only while these are registered)."""
        if not hasattr(self, "_forward_order"):
            return  # DistributedDataParallel's constructor asks before the units are known; this one's registers
        if self._hook_units_handles:
            raise RuntimeError("the forward pre-hooks are enabled already")
        self._hook_units_handles = [unit.register_forward_pre_hook(self._before_forward)
                                    for unit in self._forward_order]
        self._forward_pre_hook_handles = self._hook_units_handles

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Removes the units' pre-hooks (and so stops the releases); with `param_sync` first makes every param
        whole (a forward without the hooks needs them so)."""
        for handle in self._hook_units_handles:
            handle.remove()
        self._hook_units_handles = self._forward_pre_hook_handles = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    def broadcast_params(self) -> None:
        """Copies every bucket's params from the first rank of its data-parallel group to the others, one
        bucket gathered at a time; this rank's shard is then taken from them."""
        in_buckets = set(self.param_to_bucket)
        for buffer in self._all_buffers:
            source = dist.get_global_rank(buffer.data_parallel_group, 0)
            for bucket in buffer.buckets:
                bucket.wait_params()
                dist.broadcast(bucket.param_data, src=source, group=buffer.data_parallel_group)
                bucket.keep_own_rows()
                bucket.release_params()
        for param in self.module.parameters():
            if param not in in_buckets:
                group = self.dp_cp_group if getattr(param, "allreduce", True) else self.expert_dp_group
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
