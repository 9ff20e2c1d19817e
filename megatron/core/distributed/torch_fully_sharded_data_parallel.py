"""`TorchFullyShardedDataParallel`: a model sharded over the data-parallel ranks with PyTorch FSDP2 (`fully_shard`).

Every parameter is kept as an fp32 `DTensor` cut along dim 0 over the data x context parallel ranks (n of them),
so each rank stores 1/n of the params, of their gradients and (in the optimizer) of the Adam moments:

    per rank: 4 (fp32 param = the main param) + 4 (fp32 grad) + 8 (Adam moments) bytes per param, divided by n

Units: each transformer layer, the input embedding and the untied output layer, then the root (whatever is
left: final norm, a tied embedding). Around a unit's forward its params are all-gathered in the compute dtype
(bf16 with --bf16), and freed again after it (`reshard_after_forward`, ZeRO-3) or after its backward
(ZeRO-2); in backward its gradients are reduce-scattered, in the reduce dtype (fp32 unless
`grad_reduce_in_fp32` is off), into each rank's fp32 shard:

    grad shard on rank r = rows of r of  (1/n) x sum over ranks q of g_q      (the mean gradient, as DDP's)

(a plain sum with `calculate_per_token_loss`, which divides by the global token count afterwards). FSDP2
prefetches the next unit's all-gather during the current unit's compute and runs the reduce-scatters on a
stream of their own, so both collectives overlap with compute whatever --overlap-grad-reduce and
--overlap-param-gather say.

Tensor parallelism stays inside: the params FSDP shards are the TP-local shards, gathered back into plain
tensors before the TP layers see them, so the mesh is the data-parallel group of this TP rank.

The gradients of all microbatches but the last are reduce-scattered too (`no_sync` accumulates nothing
unsharded): a full-size gradient is what FSDP exists to avoid.
"""

from contextlib import contextmanager
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .. import parallel_state
from .data_parallel_base import _BaseDataParallel
from ..dtensor_shards import is_fully_sharded, local_tensor
from ..models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from ..transformer.transformer_layer import TransformerLayer

# The output layer is sharded as a unit of its own when it holds its own weight (an untied output layer).
OUTPUT_LAYER_NAME = "output_layer"


def _compute_dtype(config) -> torch.dtype:
    if getattr(config, "fp16", False):
        raise ValueError("FSDP (--use-torch-fsdp2, --use-megatron-fsdp) with --fp16 is not supported yet (its loss "
                         "scaling over sharded gradients is not built); use --bf16")
    return torch.bfloat16 if getattr(config, "bf16", False) else torch.float32


def _units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The submodules sharded as units of their own, in forward order: transformer layers, the input embedding
    (unless the output layer reuses its weight: the root then holds it, gathered once for both), the output
    layer where it has a weight of its own."""
    tied = any(getattr(sub, "share_embeddings_and_output_weights", False) for sub in module.modules())
    units = []
    for name, sub in module.named_modules():
        if isinstance(sub, TransformerLayer):
            units.append(sub)
        elif isinstance(sub, LanguageModelEmbedding) and not tied:
            units.append(sub)
        elif name.split(".")[-1] == OUTPUT_LAYER_NAME and getattr(sub, "weight", None) is not None and not tied:
            units.append(sub)
    return units


def _prefetch_next_layers(module: torch.nn.Module) -> None:
    """Each transformer layer gathers the next layer of its block as soon as its own params are gathered, so
    that gather runs during this layer's compute. FSDP2 otherwise starts a unit's gather only when the host
    reaches the unit's forward, which is late when the host is the bottleneck (profiled GPT 1.3B step at DP=2 on
    H100s: the compute stream waited 90 ms a step on gathers before, 15 ms after). Only within a block's layer
    list: every one of those runs in every forward, so no
    gathered unit is left waiting with stale params over an optimizer step."""
    for block in module.modules():
        layers = [sub for sub in block.children() if isinstance(sub, TransformerLayer) and isinstance(sub, FSDPModule)]
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])


def _param_attributes(module: torch.nn.Module) -> Dict[str, dict]:
    """{param name: the attributes set on it (TP layout, `shared`, `allreduce`, ...)}: fully_shard replaces
    every param by a new DTensor param without them (pytorch/pytorch#136929)."""
    return {name: dict(vars(param)) for name, param in module.named_parameters()}


class TorchFullyShardedDataParallel(_BaseDataParallel):
    """Wraps `module` (a model chunk on its device, not in a Float16Module) and shards it in place, in fp32;
    the interface of `DistributedDataParallel`, for the training loop and `finalize_model_grads`.

    `config`: the model's TransformerConfig (read: bf16 / fp16, calculate_per_token_loss);
    `ddp_config`: a `TorchFullyShardedDataParallelConfig` (reshard_after_forward, grad_reduce_in_fp32) or a
    plain `DistributedDataParallelConfig` (then ZeRO-3); `process_group`: the ranks to shard over (default:
    data x context parallel); `disable_bucketing`: DDP's argument, meaningless here (FSDP2 communicates per unit).
    """

    def __init__(self, config, ddp_config, module: torch.nn.Module, disable_bucketing: bool = False,
                 process_group=None):
        super().__init__(config, module)
        self.ddp_config = ddp_config
        if ddp_config.use_distributed_optimizer:
            raise ValueError("FSDP shards the optimizer state itself: it cannot be combined with the distributed "
                             "optimizer (--use-distributed-optimizer)")
        self.process_group = process_group or parallel_state.get_data_parallel_group(with_context_parallel=True)
        self._check_expert_params()

        compute_dtype = _compute_dtype(config)
        reduce_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else compute_dtype
        device = next(module.parameters()).device
        mesh = DeviceMesh.from_group(self.process_group, device.type)
        reshard = getattr(ddp_config, "reshard_after_forward", True)
        attributes = _param_attributes(module)
        # A unit's inputs pass as they come, as into a layer of a DDP run: the hidden states are in the compute
        # dtype already (or fp32 with --fp32-residual-connection), the rotary angles stay fp32. FSDP2 casts the
        # inputs in forward but not when activation recompute re-runs the forward in backward, which then
        # computed other values than it saved (and bf16 angles are off by whole radians at long positions).
        layer_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                           cast_forward_inputs=False)
        for unit in _units(module):
            self._prepare_unsharded_params(unit)
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=layer_policy)
        _prefetch_next_layers(module)
        # The root's params (final norm, a tied embedding) are used again at the start of backward: keeping them
        # gathered saves an all-gather. The last pipeline stage's outputs (losses, logits) come out in fp32, as
        # Float16Module's; an earlier stage sends its activations on in the compute dtype.
        last_stage = getattr(module, "post_process", True)
        root_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                           output_dtype=torch.float32 if last_stage else None)
        self._prepare_unsharded_params(module)
        fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=root_policy)
        for name, param in module.named_parameters():
            for attribute, value in attributes[name].items():
                setattr(param, attribute, value)
            # A checkpoint holds the model in the dtype a DDP run keeps its params in (model_sharding.py).
            param.saved_dtype = compute_dtype
        if getattr(config, "calculate_per_token_loss", False):
            # Sum over the ranks; finalize_model_grads divides by the global token count.
            for sub in self.fsdp_modules():
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)

    def fsdp_modules(self) -> List[FSDPModule]:
        return [sub for sub in self.module.modules() if isinstance(sub, FSDPModule)]

    def _check_expert_params(self) -> None:
        """Expert params (`allreduce=False`) are averaged over the expert data-parallel group: the same ranks as
        the dense params' only without expert parallelism."""
        if all(getattr(param, "allreduce", True) for param in self.module.parameters()):
            return
        expert_ranks = dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group())
        if expert_ranks != dist.get_process_group_ranks(self.process_group):
            raise ValueError("FSDP with expert parallelism (--expert-model-parallel-size > 1) is not supported yet: "
                             "the experts' data-parallel ranks differ from the dense params'")

    @torch.no_grad()
    def _prepare_unsharded_params(self, unit: torch.nn.Module) -> None:
        """Makes the params of `unit` not sharded yet fp32 (a model built in bf16 gets the fp32 main params that
        Float16OptimizerWithFloat16Params would start from) and copies them from the first rank of the group to
        the others, as DDP does. Unit by unit, so that only one unit is ever held whole in fp32."""
        source = dist.get_global_rank(self.process_group, 0)
        for param in unit.parameters():
            if is_fully_sharded(param):
                continue
            if param.dtype != torch.float32:
                param.data = param.data.float()
            if dist.get_world_size(self.process_group) > 1:
                dist.broadcast(param.data, src=source, group=self.process_group)

    @contextmanager
    def no_sync(self):
        """Nothing to hold back: each microbatch's gradients are reduce-scattered into the shards (module
        docstring)."""
        yield

    def start_grad_sync(self, *unused) -> None:
        """FSDP2 launches the reduce-scatters during backward itself."""

    def finish_grad_sync(self) -> None:
        """FSDP2 has waited for its reduce-scatters at the end of backward: the shards hold the reduced grads."""

    def start_param_sync(self, *unused, force_sync: bool = False) -> None:
        """The params are gathered unit by unit in forward; the optimizer updated the shards in place."""

    def scale_gradients(self, scaling_factor) -> None:
        """Multiplies this rank's gradient shards by `scaling_factor` (a float or a 1-element tensor)."""
        grads = self.main_grad_buffers()
        if grads:
            torch._foreach_mul_(grads, scaling_factor)

    def main_grad_buffers(self) -> List[torch.Tensor]:
        """This rank's gradient shards (the local pieces of the DTensor gradients)."""
        return [local_tensor(param.grad) for param in self.module.parameters() if param.grad is not None]

    def reduced_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's rows of `param`'s reduced gradient (its copies on other TP ranks or pipeline stages are
        sharded alike, so they hold the same rows)."""
        return local_tensor(param.grad)

    def zero_grad_buffer(self) -> None:
        """Drops the gradients: the first reduce-scatter of the next step writes them afresh."""
        for param in self.module.parameters():
            param.grad = None

    def broadcast_params(self) -> None:
        """Done before sharding, in the constructor."""
