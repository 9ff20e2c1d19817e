"""Contiguous gradient buffers and their communication buckets.

All params of one (param dtype, grad dtype) pair share one flat grad buffer, laid out in REVERSE
parameter order (roughly the order backward produces gradients), and each param's `main_grad` is a
view into it:

    grad_data  [ p_n | p_n-1 | ... | p_2 | p_1 ]        (numel = sum of param sizes, no padding)
               |<- bucket 0 ->|<- bucket 1 ->|...       each bucket closes once it holds >= bucket_size

A bucket is what one collective reduces; with overlap (a later change) each bucket's all-reduce starts
as soon as backward has produced all of its gradients.
"""

import logging
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .distributed_data_parallel_config import DistributedDataParallelConfig

logger = logging.getLogger(__name__)


class _ParamAndGradBucket:
    """The grads of `params`, a contiguous `grad_data` slice starting at `offset` in the buffer."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        grad_data: torch.Tensor,
        offset: int,
        gradient_scaling_factor: float,
        bucket_id: int,
    ):
        self.params_list = params
        self.params = set(params)
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = grad_data.numel()
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.param_to_index = {}
        start = 0
        for param in params:
            self.param_to_index[param] = (start, start + param.numel())
            start += param.numel()


class _ParamAndGradBuffer:
    """One flat grad buffer for `params` (all of `param_dtype`), split into buckets of ~`bucket_size`.

    `gradient_scaling_factor` multiplies the gradients before the collective: 1/data-parallel size for
    a mean by summation, 1 when the collective averages or the loss is normalised per token.
    """

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
    ):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = params
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.param_to_name = param_to_name
        self.gradient_scaling_factor = gradient_scaling_factor
        devices = {param.device for param in params}
        if len(devices) != 1:
            found = sorted(map(str, devices))
            raise ValueError(f"DistributedDataParallel needs all params on one device, found {found}")

        # Lay params out back to front and cut a bucket whenever it reaches bucket_size elements.
        self.param_index_map = {}  # param -> (start, end, bucket id) in grad_data
        bucket_ranges = []  # (start, end, params) per bucket
        bucket_start, offset, bucket_params = 0, 0, []
        for param in reversed(params):
            end = offset + param.numel()
            self.param_index_map[param] = (offset, end, len(bucket_ranges))
            bucket_params.append(param)
            offset = end
            if bucket_size is not None and end - bucket_start >= bucket_size:
                bucket_ranges.append((bucket_start, end, bucket_params))
                bucket_start, bucket_params = end, []
        if bucket_params:
            bucket_ranges.append((bucket_start, offset, bucket_params))

        self.numel = offset
        self.numel_unpadded = offset
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=devices.pop())
        for param in params:
            start, end, _ = self.param_index_map[param]
            param.main_grad = self.grad_data[start:end].view(param.shape)
        self.buckets = [
            _ParamAndGradBucket(bucket_params, self.grad_data[start:end], start, gradient_scaling_factor, bucket_id)
            for bucket_id, (start, end, bucket_params) in enumerate(bucket_ranges)
        ]
        self.param_to_bucket = {param: bucket for bucket in self.buckets for param in bucket.params_list}
        logger.info(
            "number of buckets for gradient all-reduce (%s params, %s grads): %d\n%s",
            param_dtype, grad_dtype, len(self.buckets),
            "\n".join(
                f"bucket {bucket.bucket_id} ({bucket.grad_data.numel()} elements): "
                + ", ".join(param_to_name[param] for param in bucket.params_list)
                for bucket in self.buckets
            ),
        )

    def scale_gradients(self, scaling_factor: float) -> None:
        """grad_data *= scaling_factor."""
        self.grad_data *= scaling_factor

    def reset(self) -> None:
        """Zeros the gradients (start of an iteration)."""
        self.grad_data.zero_()

    def _check_grads_are_finite(self) -> None:
        # One stacked check per buffer, so the host waits for the device once, not once per bucket.
        norms = torch.stack([bucket.grad_data.norm(p=2) for bucket in self.buckets])
        if torch.isfinite(norms).all():
            return
        bad = next(bucket for bucket, norm in zip(self.buckets, norms) if not torch.isfinite(norm))
        names = ", ".join(self.param_to_name[param] for param in bad.params_list)
        raise RuntimeError(
            f"rank {dist.get_rank()}: found {norms[bad.bucket_id].item()} in the local gradient norm of bucket "
            f"{bad.bucket_id} ({names}) in the backward pass, before the data-parallel all-reduce"
        )

    def all_reduce_gradients(self) -> None:
        """Scales and all-reduces every bucket over the data-parallel group (synchronously)."""
        if self.ddp_config.check_for_nan_in_grad:
            self._check_grads_are_finite()
        average = self.ddp_config.average_in_collective
        # gloo has no ReduceOp.AVG: sum, then divide by the group size, which is the same mean.
        emulate_average = average and dist.get_backend(self.data_parallel_group) == "gloo"
        op = dist.ReduceOp.AVG if average and not emulate_average else dist.ReduceOp.SUM
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            dist.all_reduce(bucket.grad_data, op=op, group=self.data_parallel_group)
            if emulate_average:
                bucket.grad_data /= self.data_parallel_world_size
