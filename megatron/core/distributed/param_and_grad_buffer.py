"""Contiguous gradient (and parameter) buffers, cut into communication buckets.

All params of one (param dtype, grad dtype) pair share one flat grad buffer; each param's `main_grad`
is a view into it. With the distributed optimizer there is a param buffer of the same layout too, and
`param.data` itself becomes a view into it, so that one all-gather per bucket refreshes the params:

    grad_data   [ p_n | p_n-1 | ... | p_1 ]       layout and padding: buffer_layout.py
    param_data  [ p_n | p_n-1 | ... | p_1 ]       (distributed optimizer only; uint8 for weights stored in
                                                  FP8, each `param.data` a float8 view of its bytes)
                |<- bucket 0 ->|<- bucket 1 ->|   the collectives: param_and_grad_bucket.py
"""

import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .buffer_layout import compute_buffer_layout, owned_ranges
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_bucket import _ParamAndGradBucket

logger = logging.getLogger(__name__)


class _ParamAndGradBuffer:
    """One flat grad buffer (and param buffer with the distributed optimizer) for `params`, all of
    `param_dtype`, split into buckets of ~`bucket_size` elements (None: one bucket).

    `gradient_scaling_factor` multiplies the gradients before the collective: 1/data-parallel size for
    a mean by summation, 1 when the collective averages or the loss is normalised per token.
    `param_layers` ({param: transformer layer}, optional): buckets close only between layers.
    `param_index_map[param]` = (start, end, bucket id) in the buffer.
    """

    bucket_class = _ParamAndGradBucket  # a subclass may keep its buckets' gradients otherwise

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: List[torch.nn.Parameter],
        data_parallel_group: dist.ProcessGroup,
        bucket_size: Optional[int],
        param_to_name: Dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
        param_layers: Optional[Dict[torch.nn.Parameter, int]] = None,
    ):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = params
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.param_to_name = param_to_name
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_data = None
        devices = {param.device for param in params}
        if len(devices) != 1:
            found = sorted(map(str, devices))
            raise ValueError(f"DistributedDataParallel needs all params on one device, found {found}")
        device = devices.pop()

        layout = compute_buffer_layout(
            [param.numel() for param in params],
            bucket_size,
            self.data_parallel_world_size,
            ddp_config.use_distributed_optimizer,
            [self._needs_own_bucket(param, param_layers) for param in params],
            None if param_layers is None else [param_layers.get(param) for param in params],
        )
        self.numel = layout.numel
        self.numel_unpadded = layout.numel_unpadded
        self.param_index_map = {param: layout.param_ranges[index] for index, param in enumerate(params)}
        bucket_grads = self._allocate_grads(layout, device)
        bucket_params = self._allocate_params(layout, device) if ddp_config.use_distributed_optimizer else None
        for param in params:
            start, end, bucket_id = self.param_index_map[param]
            bucket_start = layout.buckets[bucket_id].start
            if bucket_params is not None:
                initial = param.data
                param.data = bucket_params[bucket_id][start - bucket_start : end - bucket_start].view(param.dtype).view(
                    param.shape)
                param.data.copy_(initial)
            param.main_grad = bucket_grads[bucket_id][start - bucket_start : end - bucket_start].view(param.shape)

        self.buckets = [
            self.bucket_class(
                [params[index] for index in bucket.param_indices],
                None if bucket_params is None else bucket_params[bucket.bucket_id],
                bucket_grads[bucket.bucket_id],
                bucket.start,
                bucket.numel_unpadded,
                gradient_scaling_factor,
                bucket.bucket_id,
                ddp_config,
                data_parallel_group,
                self.param_index_map,
            )
            for bucket in layout.buckets
        ]
        self.param_to_bucket = {param: bucket for bucket in self.buckets for param in bucket.params_list}
        logger.info(
            "number of buckets for gradient all-reduce / reduce-scatter (%s params, %s grads): %d\n%s",
            param_dtype, grad_dtype, len(self.buckets),
            "\n".join(
                f"bucket {bucket.bucket_id} ({bucket.numel_unpadded} elements, {bucket.grad_data.numel()} padded): "
                + ", ".join(param_to_name[param] for param in bucket.params_list)
                for bucket in self.buckets
            ),
        )

    def _allocate_grads(self, layout, device: torch.device) -> List[torch.Tensor]:
        """Each bucket's gradient storage: here views into one zeroed flat buffer, `self.grad_data`."""
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)
        return [self.grad_data[bucket.start : bucket.end] for bucket in layout.buckets]

    def _allocate_params(self, layout, device: torch.device) -> List[torch.Tensor]:
        """Each bucket's param storage (distributed optimizer): views into one flat buffer, `self.param_data`."""
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        return [self.param_data[bucket.start : bucket.end] for bucket in layout.buckets]

    def _needs_own_bucket(self, param: torch.nn.Parameter, param_layers: Optional[dict]) -> bool:
        """Whether `param` gets a bucket of its own (buffer_layout.py): the shared embedding."""
        return getattr(param, "shared_embedding", False)

    def owned_pieces(self) -> Dict[torch.nn.Parameter, Tuple[_ParamAndGradBucket, Tuple[int, int], Tuple[int, int]]]:
        """With the distributed optimizer, the pieces of its params that this data-parallel rank owns:
        {param: (bucket, (start, end) in the bucket's `grad_shard`, (start, end) in the flattened param)};
        params of which it owns nothing are left out."""
        rank = dist.get_rank(self.data_parallel_group)
        pieces = {}
        for bucket in self.buckets:
            in_bucket = {param: self.param_index_map[param][:2] for param in bucket.params_list}
            end = bucket.offset + bucket.grad_data.numel()
            for param, (_, local, in_param) in owned_ranges(
                in_bucket, bucket.offset, end, rank, self.data_parallel_world_size
            ).items():
                pieces[param] = (bucket, local, in_param)
        return pieces

    def owned_grad_pieces(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """{param: this rank's piece of its reduced gradient}, flat views into the buckets' `grad_shard` (see
        `owned_pieces`)."""
        return {param: bucket.grad_shard[local[0] : local[1]]
                for param, (bucket, local, _) in self.owned_pieces().items()}

    def scale_gradients(self, scaling_factor: float) -> None:
        """grad_data *= scaling_factor."""
        self.grad_data *= scaling_factor

    def reset(self) -> None:
        """Empties the gradients and starts a new reduction round (start of an iteration): each param is
        marked `overwrite_main_grad` instead of a pass zeroing the buffer (distributed_data_parallel.py); the
        padding between params is never written and stays zero."""
        for bucket in self.buckets:
            bucket.reset()
        for param in self.params:
            param.overwrite_main_grad = True

    def start_grad_sync(self, async_op: bool) -> None:
        """Launches the reduction of every bucket that backward has not launched yet."""
        for bucket in self.buckets:
            if not bucket.grad_reduce_started:
                bucket.start_grad_sync(async_op)

    def finish_grad_sync(self) -> None:
        """Completes every bucket's reduction (launching those not launched yet), then checks for nan/inf."""
        for bucket in self.buckets:
            bucket.finish_grad_sync()
        if self.ddp_config.check_for_nan_in_grad:
            self._check_local_grads_were_finite()

    def _check_local_grads_were_finite(self) -> None:
        # One stacked check per buffer, so the host waits for the device once, not once per bucket.
        norms = torch.stack([bucket.local_grad_norm for bucket in self.buckets])
        if torch.isfinite(norms).all():
            return
        bad = next(bucket for bucket, norm in zip(self.buckets, norms) if not torch.isfinite(norm))
        names = ", ".join(self.param_to_name[param] for param in bad.params_list)
        raise RuntimeError(
            f"rank {dist.get_rank()}: found {norms[bad.bucket_id].item()} in the local gradient norm of bucket "
            f"{bad.bucket_id} ({names}) in the backward pass, before the data-parallel reduction"
        )

    def start_param_sync(self) -> None:
        """After a distributed-optimizer step: gathers every bucket's params from their owners, now, or with
        overlap_param_gather asynchronously, in the order forward needs them (back to front: the last bucket
        holds the first params), each waited for by the forward pre-hooks (param_and_grad_bucket.py)."""
        for bucket in reversed(self.buckets):
            bucket.start_param_gather(async_op=self.ddp_config.overlap_param_gather)

    def complete_param_sync(self) -> None:
        """Makes every param whole now (waits for the gathers in flight)."""
        for bucket in self.buckets:
            bucket.wait_param_gather()
