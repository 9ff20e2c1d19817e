"""A communication bucket: a contiguous stretch of the grad (and param) buffer that one collective moves.

Gradient reduction over the data-parallel group (dp ranks), so that every rank holds the mean gradient,
or with the distributed optimizer its own shard of it:

    grad_data *= gradient_scaling_factor                 1/dp: a mean by summation (1 when the collective
                                                         averages or the loss is normalised per token);
                                                         over NCCL folded into the collective instead
                                                         (a premultiplied sum: no pass of its own)
    plain DDP               all_reduce(grad_data)
    distributed optimizer   reduce_scatter(grad_data) -> grad_data[r*S : (r+1)*S]   S = numel / dp,
                                                         rank r owns shard r (the rest is left unreduced)

With overlap_grad_reduce the collective is launched asynchronously as soon as the last param of the bucket
has received its gradient of the last microbatch (`register_grad_ready`), while backward goes on with the
layers below; `finish_grad_sync` waits for it.

Parameter all-gather (distributed optimizer), after rank r updated shard r of param_data:

    all_gather(param_data[r*S : (r+1)*S]) -> param_data

With overlap_param_gather every bucket's gather is launched asynchronously right after the optimizer step,
in the order forward needs them, and the forward pre-hook of each module that holds a param of the bucket waits
for it: the gathers run one after another on NCCL's stream while the host ends the step and forward begins,
each well ahead of its layers. (Megatron-LM launches each bucket's gather from the pre-hook of the bucket before,
on the host's path through the forward: in a profiled DP=2 step of a GPT 1.3B, whose forward the host barely
kept ahead of, the compute stream then waited ~220 us a layer while the host launched the next gather.)
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from ..fusions.fused_weight_gradient import takes_main_grad
from .distributed_data_parallel_config import DistributedDataParallelConfig

# torch 2.13 renamed the tensor-in / tensor-out collectives; older versions only have the first names.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ParamAndGradBucket:
    """The grads (and, with the distributed optimizer, the params) of `params`: a slice of the buffers that
    starts at `offset`. `param_to_index[param]` is the param's (start, end) within the bucket."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        param_data: Optional[torch.Tensor],
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
        ddp_config: DistributedDataParallelConfig,
        data_parallel_group: dist.ProcessGroup,
        param_index_map: dict,
    ):
        self.params_list = params
        self.params = set(params)
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        self.ddp_config = ddp_config
        self.data_parallel_group = data_parallel_group
        self.param_to_index = {param: (param_index_map[param][0] - offset, param_index_map[param][1] - offset)
                               for param in params}

        world_size = dist.get_world_size(data_parallel_group)
        self.data_parallel_world_size = world_size
        self.grad_shard = self.param_shard = None
        if ddp_config.use_distributed_optimizer:
            shard_size, rank = grad_data.numel() // world_size, dist.get_rank(data_parallel_group)
            shard = slice(rank * shard_size, (rank + 1) * shard_size)
            self.grad_shard = grad_data[shard]
            self.param_shard = param_data[shard]

        average = ddp_config.average_in_collective
        # gloo has had no ReduceOp.AVG for most torch versions: sum, then divide by the group size.
        self._divide_after_reduce = average and dist.get_backend(data_parallel_group) == "gloo"
        self._reduce_op = dist.ReduceOp.AVG if average and not self._divide_after_reduce else dist.ReduceOp.SUM
        # NCCL multiplies each input by the factor (and 1/dp for an average) as it reads it, as FSDP2 does:
        # the pass of `grad_data *= factor` over the whole bucket is saved, the sum is the same. fp32
        # gradients only: torch up to 2.12 hands NCCL a bf16 premultiplied sum's factor with the wrong width
        # (a power of two reads as zero: pytorch/pytorch#190745).
        self.scales_in_collective = (gradient_scaling_factor != 1.0 and world_size > 1
                                     and grad_data.dtype == torch.float32
                                     and dist.get_backend(data_parallel_group) == "nccl")
        if self.scales_in_collective:
            self._reduce_op = dist._make_nccl_premul_sum(gradient_scaling_factor / (world_size if average else 1))

        # Gradient reduction of the current round (reset by finish_grad_sync / reset).
        self.params_with_grad = set()
        self.grad_reduce_started = False
        self.grad_reduce_handle = None
        self.local_grad_norm = None  # before the reduction, for check_for_nan_in_grad
        # Parameter all-gather: the params start out identical on every rank, so none is in flight yet.
        self.param_gather_handle = None

    # --- gradient reduction ------------------------------------------------------------------------------
    def zero_unwritten_grads(self) -> None:
        """Zeroes `main_grad` of each param that nothing wrote since it was marked empty (`overwrite_main_grad`:
        a param unused by this step's backward), before the reduction reads it."""
        for param in self.params_list:
            if takes_main_grad(param):
                param.main_grad.zero_()

    def start_grad_sync(self, async_op: bool) -> None:
        """Scales this bucket's grads and launches their all-reduce (reduce-scatter with the distributed optimizer)."""
        self.zero_unwritten_grads()
        if self.ddp_config.check_for_nan_in_grad:
            self.local_grad_norm = self.grad_data.norm(p=2)
        if self.gradient_scaling_factor != 1.0 and not self.scales_in_collective:
            self.grad_data *= self.gradient_scaling_factor
        if self.data_parallel_world_size == 1:
            # Nothing to reduce: a collective over one rank would still read (and an average divide) the
            # whole buffer, a pass over 4 bytes per parameter.
            self.grad_reduce_started, self.grad_reduce_handle = True, None
            return
        if self.ddp_config.use_distributed_optimizer:
            handle = _reduce_scatter_tensor(
                self.grad_shard, self.grad_data, op=self._reduce_op, group=self.data_parallel_group, async_op=async_op
            )
        else:
            handle = dist.all_reduce(self.grad_data, op=self._reduce_op, group=self.data_parallel_group,
                                     async_op=async_op)
        self.grad_reduce_started = True
        self.grad_reduce_handle = handle if async_op else None
        if not async_op:
            self._complete_average()

    def _complete_average(self) -> None:
        if self._divide_after_reduce:
            reduced = self.grad_shard if self.ddp_config.use_distributed_optimizer else self.grad_data
            reduced /= self.data_parallel_world_size

    def finish_grad_sync(self) -> None:
        """Completes this round's reduction, launching it now when backward did not; then starts a new round."""
        if not self.grad_reduce_started:
            self.start_grad_sync(async_op=False)
        elif self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
            self._complete_average()
        self.grad_reduce_started = False
        self.params_with_grad = set()

    def register_grad_ready(self, param: torch.nn.Parameter, name: str) -> None:
        """Notes that `param` has its final gradient of this round; the last one launches the async reduction."""
        if self.grad_reduce_started or param in self.params_with_grad:
            raise RuntimeError(
                f"{name} received a second gradient in one reduction round (bucket {self.bucket_id}): with "
                "overlap_grad_reduce (--overlap-grad-reduce) run every microbatch but the last under no_sync(), "
                "and call finish_grad_sync() before the next backward"
            )
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync(async_op=True)

    def reset(self) -> None:
        """Starts a new round (the buffer is being zeroed): waits for a reduction still in flight first."""
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        self.grad_reduce_started = False
        self.params_with_grad = set()

    # --- parameter all-gather (distributed optimizer) ------------------------------------------------------
    def start_param_gather(self, async_op: bool) -> None:
        """This rank's shard changed: gathers the params from their owners, now or (async_op) in flight until
        `wait_param_gather`."""
        self.wait_param_gather()
        if self.data_parallel_world_size == 1:  # the one shard is the whole buffer
            return
        handle = _all_gather_into_tensor(self.param_data, self.param_shard, group=self.data_parallel_group,
                                         async_op=async_op)
        self.param_gather_handle = handle if async_op else None

    def wait_param_gather(self) -> None:
        """The params are whole once this returns (the current stream waits for a gather in flight)."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
