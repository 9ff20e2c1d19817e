"""`DistributedOptimizer`: Megatron's ZeRO-1-style optimizer, sharded over the data-parallel ranks.

DDP pads every bucket so that dp divides it (distributed/buffer_layout.py) and cuts it into dp equal
contiguous shards; data-parallel rank r owns shard r of every bucket. Shards ignore param boundaries,
so a param may be split over several ranks:

    bucket        [    shard 0    |    shard 1    | ... ]
    params        [ p_5 |.| p_4 |.|  p_3  |.| p_2 ... ]      rank 0 owns p_5, p_4 and the head of p_3

For each param overlapping its shards a rank holds only the overlapping piece:

    model shard   param.view(-1)[a:b]                 a view into DDP's param buffer (its bucket's `param_shard`)
    main shard    an fp32 copy of it (bf16/fp16 params), or the model shard itself (fp32 params); for a
                  weight stored in FP8 an fp32 copy of its value (its initial weight, or dequantized)
    Adam state    exp_avg, exp_avg_sq of the main shard, fp32 or (--use-precision-aware-optimizer
                  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) bf16

One step:
    DDP reduce-scatter      rank r's shard of the grad buffer holds the mean gradient
    main_shard.grad         = that shard's slice, as fp32
    unscale, inf/nan check, global grad norm and clipping: over all ranks, each entry counted by its owner
    Adam on the main shards, cast back into the param buffer's shard (weights stored in FP8: cast to FP8,
        the amax of each such weight reduced over the data-parallel group, megatron/core/fp8/params.py)
    all-gather the param buffer (at once, or during the next forward with overlap_param_gather)

Bytes per param with bf16 params and fp32 grads: 2 + 4 + 12/dp instead of 18 (2 + 4 + 8/dp with bf16
moments). The checkpoint format (`get_parameter_state_dp_zero`, `distrib_optim.pt`) is in
distrib_optimizer_state.py; checkpoints hold the moments in fp32 whatever their dtype here, as Megatron-LM
writes them (its Transformer Engine Adam widens bf16 moments when saving and rounds them when loading), so a
checkpoint loads under either setting.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..fp8.params import (
    cast_into_fp8_params,
    dequantize_fp8_param,
    fp8_params,
    high_precision_value,
    is_fp8_param,
    release_initial_weights,
)
from ..fusions.adamw_reference import new_adam_state
from .distrib_optimizer_state import ADAM_STATE_KEYS, gather_parameter_state_dp_zero, scatter_parameter_state_dp_zero
from .grad_scaler import MegatronGradScaler
from .optimizer import MixedPrecisionOptimizer, copy_layout_attributes, take_grad
from .optimizer_config import OptimizerConfig
from .param_groups import reorder_saved_param_groups

# How torch runs the update here, not a hyper-parameter: a checkpoint written on a GPU (fused) must load on a CPU.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


@dataclass(frozen=True)
class ShardRange:
    """This rank's piece of a param: [param_start, param_end) of the flattened param, which sits at
    [local_start, local_end) of this rank's shard of the param's bucket."""

    local_start: int
    local_end: int
    param_start: int
    param_end: int


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Shards the fp32 main params and Adam state of `optimizer`'s params over the data-parallel ranks.

    `optimizer` is an Adam/AdamW built over the model params (in their param groups); its groups are
    rewritten to hold this rank's main shards. `buffers` are the DDP buffers holding those params
    (`DistributedDataParallel.buffers`, or `expert_parallel_buffers` for expert params), built with
    `use_distributed_optimizer`. `data_parallel_group_gloo` (optional) is a gloo twin of the buffers'
    group, used on CPU for checkpoint gathers; without it they go over the buffers' own group.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        buffers: Sequence,
        data_parallel_group_gloo: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__(optimizer, config, grad_scaler)
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(
                f"the distributed optimizer (--use-distributed-optimizer) supports Adam only (--optimizer adam), "
                f"got {type(optimizer).__name__}, as in Megatron-LM"
            )
        if not all(buffer.ddp_config.use_distributed_optimizer for buffer in buffers):
            raise ValueError(
                "the distributed optimizer needs the model wrapped in DistributedDataParallel with "
                "DistributedDataParallelConfig(use_distributed_optimizer=True)"
            )
        self.buffers = list(buffers)
        self.data_parallel_group = self.buffers[0].data_parallel_group if self.buffers else None
        self.data_parallel_group_gloo = data_parallel_group_gloo
        # Statistics over all ranks: TP/PP ranks hold different params and DP ranks different shards.
        self.grad_stats_parallel_group = dist.group.WORLD

        self.shard_ranges: Dict[torch.nn.Parameter, ShardRange] = {}
        # This rank's piece of each param's reduced gradient, in its bucket's `grad_shard` (a view into DDP's
        # grad buffer, or a buffer of its own where the gradients are sharded too: fsdp/sharded_grads.py).
        self._grad_pieces: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self._param_shards: Dict[torch.nn.Parameter, torch.Tensor] = {}  # the bucket's `param_shard`
        for buffer in self.buffers:
            for param, (bucket, local, in_param) in buffer.owned_pieces().items():
                self.shard_ranges[param] = ShardRange(*local, *in_param)
                self._param_shards[param] = bucket.param_shard
            self._grad_pieces.update(buffer.owned_grad_pieces())

        # Index-aligned lists over the params this rank owns a piece of, in param-group order.
        self.model_params: List[torch.nn.Parameter] = []
        self.model_shards: List[torch.Tensor] = []
        self.main_shards: List[torch.Tensor] = []
        self._shard_index: Dict[torch.nn.Parameter, int] = {}
        known = {param for buffer in self.buffers for param in buffer.params}
        for group in self.optimizer.param_groups:
            main_shards = []
            for param in group["params"]:
                if param not in known:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} is not in the DistributedDataParallel buffers "
                        "given to the distributed optimizer"
                    )
                if param in self.shard_ranges:
                    main_shards.append(self._add_shard(param))
            group["params"] = main_shards
        # Every rank casts all FP8 weights of its buffers (none of some), in the same order: the amax all-reduce.
        self._fp8_params = fp8_params([param for buffer in self.buffers for param in buffer.params])
        release_initial_weights(self._fp8_params)

    def _add_shard(self, param: torch.nn.Parameter) -> torch.Tensor:
        piece = self.shard_ranges[param]
        if is_fp8_param(param):
            model_shard = param.detach().view(-1)[piece.param_start : piece.param_end]
            value = high_precision_value(param).reshape(-1)[piece.param_start : piece.param_end]
            main_shard = value.to(torch.float32, copy=True)
        elif param.dtype in (torch.float16, torch.bfloat16, torch.float32):
            # This rank's piece of the bucket's param shard, the all-gather's input: the param's own memory,
            # except where the params are sharded too and `param_shard` is the one persistent copy
            # (fsdp/sharded_params.py).
            model_shard = self._param_shards[param][piece.local_start : piece.local_end]
            # fp32: Adam updates the param buffer in place.
            main_shard = model_shard if param.dtype == torch.float32 else model_shard.clone().float()
        else:
            raise ValueError(
                f"parameters must be float32, float16 or bfloat16 for the distributed optimizer, got {param.dtype} "
                f"(shape {tuple(param.shape)})"
            )
        copy_layout_attributes(main_shard, param)
        self._shard_index[param] = len(self.model_params)
        self.model_params.append(param)
        self.model_shards.append(model_shard)
        self.main_shards.append(main_shard)
        return main_shard

    def zero_grad(self, set_to_none: bool = True) -> None:
        for tensor in self.model_params + self.main_shards:
            tensor.grad = None

    def _collect_main_grads(self) -> List[torch.Tensor]:
        return [shard.grad for shard in self.main_shards if shard.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        as_is = self._main_grads_as_is()
        for param, main_shard in zip(self.model_params, self.main_shards):
            # After the reduce-scatter only this rank's shard of the grad buffer holds the mean gradient.
            take_grad(main_shard, self._grad_pieces[param], as_is)
            param.grad = None

    def _float16_shards(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(model shards, main shards) of the bf16/fp16 params (not the fp32 ones, not those stored in FP8)."""
        pairs = [(model, main) for param, model, main in zip(self.model_params, self.model_shards, self.main_shards)
                 if model is not main and not is_fp8_param(param)]
        return [model for model, _ in pairs], [main for _, main in pairs]

    def _main_to_model_params(self) -> dict:
        model_shards, main_shards = self._float16_shards()
        return dict(zip(main_shards, model_shards))

    def _copy_main_params_to_model_params(self) -> None:
        model_shards, main_shards = self._float16_shards()
        if model_shards:
            torch._foreach_copy_(model_shards, main_shards)
        self._copy_main_params_to_fp8_params()

    def _fp8_main_shards(self) -> Tuple[List[Optional[torch.Tensor]], List[int]]:
        """For each FP8 weight of the buffers: (this rank's main shard of it or None, where that starts in it)."""
        indices = [self._shard_index.get(param) for param in self._fp8_params]
        mains = [None if index is None else self.main_shards[index] for index in indices]
        starts = [0 if index is None else self.shard_ranges[param].param_start
                  for param, index in zip(self._fp8_params, indices)]
        return mains, starts

    def _copy_main_params_to_fp8_params(self) -> None:
        cast_into_fp8_params(self._fp8_params, *self._fp8_main_shards(), self.data_parallel_group)

    def _copy_model_params_to_main_params(self) -> None:
        model_shards, main_shards = self._float16_shards()
        if main_shards:
            torch._foreach_copy_(main_shards, model_shards)
        for param, main_shard, start in zip(self._fp8_params, *self._fp8_main_shards()):
            if main_shard is not None:
                main_shard.copy_(dequantize_fp8_param(param).view(-1)[start : start + main_shard.numel()])

    @torch.no_grad()
    def step_with_ready_grads(self, skip=None) -> bool:
        """Adam on the shards, then every rank's params are refreshed by the all-gather (of unchanged shards
        where `skip` vetoed the update)."""
        update_successful = super().step_with_ready_grads(skip)
        with self._timed("params-all-gather"):
            for buffer in self.buffers:
                buffer.start_param_sync()
        return update_successful

    def state_dict(self) -> dict:
        """What is the same on every data-parallel rank: the param groups (hyper-parameters and Adam's step
        count, no params) and the grad scaler. The sharded tensors come from `get_parameter_state_dp_zero`."""
        inner = self.optimizer.state_dict()
        steps = {float(state["step"]) for state in inner["state"].values() if "step" in state}
        if len(steps) > 1:
            raise RuntimeError(f"the distributed optimizer's shards are at different Adam steps {sorted(steps)}")
        step = int(steps.pop()) if steps else 0
        param_groups = [
            {**{key: value for key, value in group.items() if key != "params"}, "step": step}
            for group in inner["param_groups"]
        ]
        state_dict = {"optimizer": {"param_groups": param_groups}}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores hyper-parameters, Adam's step and the grad scaler; allocates zero Adam state (moments in
        the configured dtypes) that `load_parameter_state_from_dp_zero` then fills."""
        saved_groups = state_dict.get("optimizer", {}).get("param_groups")
        if saved_groups is None or any("params" in group for group in saved_groups):
            raise ValueError(
                "this optimizer state was saved without the distributed optimizer (it holds per-parameter "
                "state); resume without --use-distributed-optimizer, or pass --no-load-optim"
            )
        order = reorder_saved_param_groups(self.optimizer.param_groups, saved_groups, match_sizes=False)
        saved_groups = [saved_groups[saved_index] for saved_index in order]
        param_groups, index = [], 0
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            ignored = ("step", *_IMPLEMENTATION_KEYS)
            hyper_parameters = {key: value for key, value in saved.items() if key not in ignored}
            implementation = {key: group[key] for key in _IMPLEMENTATION_KEYS if key in group}
            param_groups.append({**hyper_parameters, **implementation,
                                 "params": list(range(index, index + len(group["params"])))})
            index += len(group["params"])
        # torch's load_state_dict would cast the moments to their params' dtype: the state is made afterwards.
        self.optimizer.load_state_dict({"state": {}, "param_groups": param_groups})
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            for main_shard in group["params"]:
                self.optimizer.state[main_shard] = new_adam_state(
                    main_shard, self.config.exp_avg_dtype, self.config.exp_avg_sq_dtype, saved.get("step") or 0)
        self._load_grad_scaler_state(state_dict)

    def main_param_and_state(self, param: torch.nn.Parameter) -> Dict[str, Optional[torch.Tensor]]:
        """{"param": main shard, "exp_avg": ..., "exp_avg_sq": ...} of a param this rank owns a piece of
        (Adam's tensors are None before the first step)."""
        main_shard = self.main_shards[self._shard_index[param]]
        state = self.optimizer.state.get(main_shard, {})
        return {"param": main_shard, **{key: state.get(key) for key in ADAM_STATE_KEYS}}

    def get_parameter_state_dp_zero(self) -> Optional[dict]:
        """Main params and Adam state of all ranks, gathered on data-parallel rank 0 (None elsewhere), in
        Megatron's `distrib_optim.pt` layout. Collective over the data-parallel group."""
        return gather_parameter_state_dp_zero(self)

    def load_parameter_state_from_dp_zero(self, state_dict: Optional[dict]) -> None:
        """Scatters `get_parameter_state_dp_zero()` output (given on data-parallel rank 0, None elsewhere)
        into every rank's main shards and Adam state. Call after `load_state_dict`. Collective."""
        scatter_parameter_state_dp_zero(self, state_dict)
