"""Megatron's optimizer wrappers around a `torch.optim` optimizer.

One step (`MegatronOptimizer.step`) is

    prepare_grads()            copy model grads (`param.main_grad` from DDP, else `param.grad`) to the
                               fp32 main params; fp16: unscale by 1/loss_scale and look for inf/nan on
                               every model-parallel rank; update the loss scale
    -> overflow: return (False, None, None) and leave the params untouched
    grad norm over the model-parallel group, clip to `clip_grad`
    count zeros (if asked)
    step_with_ready_grads()    inner Adam/SGD step on the fp32 main params, copy them back to the model

and returns `(update_successful, grad_norm, num_zeros_in_grad)`.

`Float16OptimizerWithFloat16Params` keeps an fp32 main copy of every bf16/fp16 parameter (the inner
optimizer only ever sees fp32 tensors); `FP32Optimizer` works on the model's fp32 params directly. A weight
stored in FP8 (megatron/core/fp8/params.py) has an fp32 main param too, which each step casts into it.
"""

import logging
from abc import ABC, abstractmethod
from typing import List, Optional

import torch

from .. import parallel_state
from ..fp8.params import (
    cast_into_fp8_params,
    dequantize_fp8_param,
    high_precision_value,
    is_fp8_param,
    release_initial_weights,
)
from ..fusions.adamw_reference import adamw_step
from ..fusions.fused_adamw import FusedAdamW
from ..tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from ..timers import timed
from .clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    grad_norm_fp32_tensor,
    param_is_not_shared,
)
from .grad_scaler import MegatronGradScaler
from .optimizer_config import OptimizerConfig
from .param_groups import reorder_saved_param_groups

logger = logging.getLogger(__name__)

# Attributes that describe how a parameter is laid out over ranks; its fp32 main copy needs them too, so
# that norms and zero counts skip replicas (and Muon splits and gathers it as the model param).
_LAYOUT_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "partition_sections", "shared",
                      "allreduce", "qkv_split_shapes")


def copy_layout_attributes(main_param: torch.Tensor, model_param: torch.nn.Parameter) -> None:
    """Gives a main param (or shard of one) the layout attributes of its model param."""
    for attribute in _LAYOUT_ATTRIBUTES:
        if hasattr(model_param, attribute):
            setattr(main_param, attribute, getattr(model_param, attribute))


# torch >= 2.10: a leaf's `grad_dtype = None` lets its `.grad` have another dtype (fp32 main params, bf16 grads).
_GRAD_DTYPE_SETTABLE = hasattr(torch.Tensor, "grad_dtype")


def take_grad(main_param: torch.Tensor, grad: torch.Tensor, as_is: bool) -> None:
    """main_param.grad = `grad` itself where `as_is` (`MixedPrecisionOptimizer._main_grads_as_is`), else an
    fp32 copy of it (no copy when it is fp32 already)."""
    if as_is and grad.dtype != main_param.dtype:
        if main_param.grad_dtype is not None:
            main_param.grad = None
            main_param.grad_dtype = None
        main_param.grad = grad
    else:
        main_param.grad = grad.float()


def _zero_grads(params: List[torch.nn.Parameter], set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_()
            param.grad.zero_()


class MegatronOptimizer(ABC):
    """Base of the optimizer wrappers: gradient statistics, clipping and the step protocol.

    `grad_stats_parallel_group` (the group over which norms, zero counts and the fp16 overflow flag
    are reduced) defaults to the model-parallel group; `tensor_parallel_rank` (which decides who counts
    replicated params) defaults to this rank's TP rank. `get_megatron_optimizer` sets both to the
    expert groups for the optimizer of expert-parallel params.
    """

    _unit_loss_scale: Optional[torch.Tensor] = None  # 1.0 on the device, made once (`_no_loss_scale`)

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig):
        self.optimizer = optimizer
        self.config = config
        self.grad_stats_parallel_group = None
        self.tensor_parallel_rank = None
        self.chained = False  # a ChainedOptimizer's member: the chain computes the norm and clips in place

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The tensors the inner optimizer updates (fp32 main params where they exist)."""
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def get_grad_stats_parallel_group(self):
        if self.grad_stats_parallel_group is not None:
            return self.grad_stats_parallel_group
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_model_parallel_group()
        return None

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """This rank's gradients that count towards the global norm (no TP replicas, no shared copies)."""
        return [
            param.grad
            for param in self.get_parameters()
            if param.grad is not None
            and param_is_not_shared(param)
            and param_is_not_tensor_parallel_duplicate(param, self.tensor_parallel_rank)
        ]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """Global L2 norm of the main gradients over the model-parallel ranks."""
        return get_grad_norm_fp32(
            self.get_main_grads_for_grad_norm(), grad_stats_parallel_group=self.get_grad_stats_parallel_group()
        )

    @torch.no_grad()
    def get_params_norm(self) -> float:
        """Global L2 norm of the main params (fp32 copies where they exist), each entry counted once over
        the same group as the gradient norm: Megatron-LM's `--log-params-norm` value."""
        params = [
            param
            for param in self.get_parameters()
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, self.tensor_parallel_rank)
        ]
        return get_grad_norm_fp32(params, grad_stats_parallel_group=self.get_grad_stats_parallel_group())

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Computes the global gradient norm, clips the main gradients to `clip_grad`, returns the norm."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm)
        return grad_norm

    @torch.no_grad()
    def count_zeros(self) -> int:
        """Zero entries in the main gradients over the model-parallel ranks."""
        return count_zeros_fp32(
            self.get_parameters(),
            grad_stats_parallel_group=self.get_grad_stats_parallel_group(),
            tensor_parallel_rank=self.tensor_parallel_rank,
        )

    def refresh_fp8_params(self) -> None:
        """Casts the main params into the weights stored in FP8 again (megatron/core/fp8/params.py): call it
        after loading the optimizer's state, whose exact main params then give those weights the bytes, scales
        and amaxes of the run that saved it (the model's checkpoint holds their FP8 values only). No-op
        without such weights."""
        return None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * loss_scale`: what to call backward on under fp16; the loss itself without loss scaling."""
        return self.get_loss_scale() * loss if self.scales_loss() else loss

    def scales_loss(self) -> bool:
        """Whether the loss is multiplied by a loss scale (fp16) before backward."""
        return True

    def _no_loss_scale(self) -> torch.Tensor:
        """`get_loss_scale` without loss scaling: 1.0 as a 1-element device tensor, the same one every call (a
        fresh one was a fill kernel and a walk over the params per call, on the host's path between steps)."""
        if self._unit_loss_scale is None:
            self._unit_loss_scale = torch.ones(1, dtype=torch.float, device=self.get_parameters()[0].device)
        return self._unit_loss_scale

    @property
    def param_groups(self) -> List[dict]:
        """The inner optimizer's param groups (the LR scheduler writes `lr`/`weight_decay` here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    def _timed(self, name: str):
        return timed(self.config.timers, name, barrier=self.config.barrier_with_L1_time)

    @torch.no_grad()
    def step(self):
        """One update; returns `(update_successful, grad_norm, num_zeros_in_grad)`, grad_norm a float.

        On an fp16 overflow nothing is updated and `(False, None, None)` comes back. The gradient norm
        is computed (and reported) even when clipping is off (`clip_grad == 0`).
        """
        update_successful, grad_norm, num_zeros_in_grad = self.step_with_device_grad_norm()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        return update_successful, grad_norm, num_zeros_in_grad

    @torch.no_grad()
    def step_with_device_grad_norm(self, veto=None):
        """`step()` without its host sync at the end: where the fused Adam kernel clips (below), grad_norm
        comes back as a 1-element tensor on the device, queued behind the update, so the host can go on
        queueing the next iteration while the GPU still runs this update (pretrain()'s loop reads it only
        when it logs). Elsewhere it returns what `step()` returns.

        `veto(grad_norm)`, when given (the training loop's bad-step check), is called once the gradient norm
        is known and before the update. It returns True to skip the update (then `(False, grad_norm, None)`
        comes back), False to go on, or, where `supports_device_veto()`, a 1-element int32 device tensor: the
        update then runs on the device only where it is 0, and the host calls `rewind_vetoed_update()` if it
        later learns it was not."""
        if self.prepare_grads():
            return False, None, None
        clip_in_update = self._clips_in_update()
        with self._timed("optimizer-clip-main-grad"):
            if clip_in_update:
                # The fused Adam kernel divides every gradient by `grad_scale` as it reads it, so clipping
                # by max_norm / (norm + 1e-6) costs no pass of its own and no host sync.
                grad_norm = grad_norm_fp32_tensor(
                    self.get_main_grads_for_grad_norm(), grad_stats_parallel_group=self.get_grad_stats_parallel_group()
                )
            else:
                grad_norm = self.get_grad_norm()
        verdict = veto(grad_norm) if veto is not None else False
        if verdict is True:
            return False, grad_norm, None
        with self._timed("optimizer-clip-main-grad"):
            if clip_in_update:
                self.optimizer.grad_scale = ((grad_norm + 1.0e-6) / self.config.clip_grad).clamp(min=1.0)
            elif self.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(self.get_parameters(), self.config.clip_grad, grad_norm)
        with self._timed("optimizer-count-zeros"):
            num_zeros_in_grad = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        try:
            update_successful = self.step_with_ready_grads(skip=verdict if torch.is_tensor(verdict) else None)
        finally:
            if clip_in_update:
                del self.optimizer.grad_scale
        return update_successful, grad_norm, num_zeros_in_grad

    def _clips_in_update(self) -> bool:
        """Whether clipping is on and folded into the update (the fused Adam kernels' grad_scale)."""
        inner = getattr(self, "optimizer", None)  # a ChainedOptimizer has several and takes the plain path
        return (self.config.clip_grad > 0.0 and not getattr(self, "chained", False)
                and getattr(inner, "_step_supports_amp_scaling", False))

    def supports_device_veto(self) -> bool:
        """Whether `step_with_device_grad_norm` can skip an update on the device (see there)."""
        return False

    def rewind_vetoed_update(self) -> None:
        """Takes back the host's side of the last update, which a device veto skipped."""
        raise RuntimeError(f"{type(self).__name__} does not skip updates on the device")

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Moves gradients into place and updates the loss scale; returns True if an inf/nan was found."""
        found_inf = self.prepare_main_grads()
        self.update_loss_scale(found_inf)
        return found_inf

    @abstractmethod
    def prepare_main_grads(self) -> bool:
        """Copies model grads to the main grads (unscaled under loss scaling); returns True on inf/nan.

        Leaves the loss scale alone, so that a `ChainedOptimizer` can combine the overflow flags of all
        its sub-optimizers before any of them updates its scale.
        """

    def update_loss_scale(self, found_inf: bool) -> None:
        """Lets the loss scaler react to this step's overflow flag (no-op without loss scaling)."""
        return None

    @abstractmethod
    def step_with_ready_grads(self, skip: Optional[torch.Tensor] = None) -> bool:
        """Runs the inner optimizer on prepared gradients; returns whether the update happened. `skip`: a
        device veto (`step_with_device_grad_norm`), only where `supports_device_veto()`."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the `.grad` of model and main params (DDP empties its `main_grad` buffers itself)."""

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a 1-element tensor (1.0 without loss scaling)."""

    @abstractmethod
    def reload_model_params(self) -> None:
        """Refreshes the main params from the model params (after loading a model without optimizer)."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Everything needed to continue training bit for bit."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores `state_dict()` output (param groups are matched by their wd/lr multipliers)."""


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared logic of optimizers whose main params are separate fp32 tensors.

    `grad_scaler` may be None only without fp16 (bf16 needs no loss scaling).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, grad_scaler: Optional[MegatronGradScaler]
    ):
        super().__init__(optimizer, config)
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler (ConstantGradScaler or DynamicGradScaler)")
        self.grad_scaler = grad_scaler
        self._fused_adamw = None  # decided at the first step, once the main params exist

    def get_loss_scale(self) -> torch.Tensor:
        return self._no_loss_scale() if self.grad_scaler is None else self.grad_scaler.scale

    def scales_loss(self) -> bool:
        return self.grad_scaler is not None

    def reload_model_params(self) -> None:
        self._copy_model_params_to_main_params()

    @torch.no_grad()
    def refresh_fp8_params(self) -> None:
        self._copy_main_params_to_fp8_params()

    def _load_grad_scaler_state(self, state_dict: dict) -> None:
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                logger.warning("checkpoint has no grad scaler state: keeping the initial loss scale")
        elif self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        else:
            logger.warning("checkpoint has grad scaler state but this run uses no loss scaling: ignoring it")

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        main_grads = self._collect_main_grads()
        found_inf = torch.zeros(1, dtype=torch.float, device=self.grad_scaler.scale.device)
        if main_grads:
            # One fused pass: g *= 1/scale, and found_inf = 1 if any entry is inf or nan.
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, self.grad_scaler.inv_scale)
        group = self.get_grad_stats_parallel_group()
        if group is not None:
            # Every model-parallel rank must skip the same steps, or the replica's shards drift apart.
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)
        return found_inf.item() > 0

    @torch.no_grad()
    def prepare_main_grads(self) -> bool:
        with self._timed("optimizer-copy-to-main-grad"):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        with self._timed("optimizer-unscale-and-check-inf"):
            return self._unscale_main_grads_and_check_for_nan()

    def update_loss_scale(self, found_inf: bool) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)

    def _fused(self):
        """(FusedAdamW, main -> model params) where the Triton AdamW applies, else False; decided once."""
        if self._fused_adamw is None:
            self._fused_adamw = False
            if FusedAdamW.supports(self.optimizer, self.get_parameters()):
                fused = FusedAdamW(self.optimizer, exp_avg_dtype=self.config.exp_avg_dtype,
                                   exp_avg_sq_dtype=self.config.exp_avg_sq_dtype)
                # The kernel writes bf16/fp16 copies; weights stored in FP8 are cast after it.
                model_of = {main: model for main, model in self._main_to_model_params().items()
                            if model.dtype in (torch.bfloat16, torch.float16)}
                self._fused_adamw = (fused, model_of)
        return self._fused_adamw

    def supports_device_veto(self) -> bool:
        return bool(self._fused()) and self.grad_scaler is None

    def _main_grads_as_is(self) -> bool:
        """Whether the main params' `.grad` can be the model's bf16/fp16 gradients themselves (DDP's buffer,
        with `--grad-reduce-in-bf16` / `--main-grads-dtype bf16`) instead of fp32 copies: where the fused AdamW
        reads them (into fp32: the update of the copy, bit for bit), nothing unscales them in place (no loss
        scaling) and clipping, if on, is folded into the update. The gradient norm reads them in fp32 too.
        Megatron-LM's precision-aware optimizer hands TE's FusedAdam the bf16 gradients the same way; copies
        cost a pass over the gradients and a fresh fp32 tensor per param every step. Needs torch >= 2.10 (an
        fp32 tensor's `.grad` may then be bf16: `grad_dtype = None`); older torch copies."""
        return (_GRAD_DTYPE_SETTABLE and self.grad_scaler is None and bool(self._fused())
                and (self.config.clip_grad == 0.0 or self._clips_in_update()))

    def rewind_vetoed_update(self) -> None:
        self._fused()[0].rewind()

    @torch.no_grad()
    def step_with_ready_grads(self, skip: Optional[torch.Tensor] = None) -> bool:
        """AdamW on the main params and the copy into the model params: one Triton kernel on a GPU
        (fusions/fused_adamw.py), else the inner optimizer's step (fusions/adamw_reference.py's where the Adam
        moments are not fp32, which torch's AdamW cannot hold) followed by a foreach copy."""
        if self._fused():
            fused, model_of = self._fused()
            with self._timed("optimizer-inner-step"):
                fused.step(model_of, getattr(self.optimizer, "grad_scale", None), skip=skip)
            # Also after an update skipped on the device: the unchanged weights with this step's scales.
            with self._timed("optimizer-copy-main-to-model-params"):
                self._copy_main_params_to_fp8_params()
            return True
        if skip is not None:
            raise ValueError("this optimizer cannot skip an update on the device (supports_device_veto() is False)")
        with self._timed("optimizer-inner-step"):
            moment_dtypes = (self.config.exp_avg_dtype, self.config.exp_avg_sq_dtype)
            if moment_dtypes == (torch.float32, torch.float32):
                self.optimizer.step()
            else:
                adamw_step(self.optimizer, *moment_dtypes, grad_scale=getattr(self.optimizer, "grad_scale", None))
        with self._timed("optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model_params()
        return True

    @abstractmethod
    def _main_to_model_params(self) -> dict:
        """{fp32 main param: the bf16/fp16 model tensor it is copied into} (params that are their own main
        param are absent)."""

    @abstractmethod
    def _collect_main_grads(self) -> List[torch.Tensor]:
        """The fp32 main gradients to unscale."""

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None:
        """Makes the model's gradients the main params' `.grad`."""

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None:
        """Writes the updated main params back into the model params (those stored in FP8 included)."""

    @abstractmethod
    def _copy_main_params_to_fp8_params(self) -> None:
        """Casts the main params of the weights stored in FP8 into them (megatron/core/fp8/params.py)."""

    @abstractmethod
    def _copy_model_params_to_main_params(self) -> None:
        """Overwrites the main params with the model params."""


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp32 main params for bf16/fp16 model params (and weights stored in FP8, cast whole after each step);
    fp32 model params are updated in place.

    Three lists per param group, index-aligned:
      float16_groups            the model's bf16/fp16 params (and FP8 ones)
      fp32_from_float16_groups  their fp32 main copies (what the inner optimizer holds)
      fp32_from_fp32_groups     the model's fp32 params (held by the inner optimizer directly)
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, grad_scaler: Optional[MegatronGradScaler]
    ):
        super().__init__(optimizer, config, grad_scaler)
        self.float16_groups = []
        self.fp32_from_float16_groups = []
        self.fp32_from_fp32_groups = []
        for param_group in self.optimizer.param_groups:
            float16_params, fp32_from_float16_params, fp32_params = [], [], []
            for index, param in enumerate(param_group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in (torch.float16, torch.bfloat16) or is_fp8_param(param):
                    value = high_precision_value(param) if is_fp8_param(param) else param.detach()
                    main_param = value.to(torch.float32, copy=True)
                    copy_layout_attributes(main_param, param)
                    param_group["params"][index] = main_param
                    param.main_param = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    float16_params.append(param)
                    fp32_from_float16_params.append(main_param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise ValueError(
                        f"parameters must be float32, float16 or bfloat16 for the mixed-precision optimizer, "
                        f"got {param.dtype} (shape {tuple(param.shape)})"
                    )
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(fp32_from_float16_params)
            self.fp32_from_fp32_groups.append(fp32_params)
        release_initial_weights([param for group in self.float16_groups for param in group])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grads(group, set_to_none)

    def _collect_main_grads(self) -> List[torch.Tensor]:
        main_params = [p for group in self.fp32_from_float16_groups + self.fp32_from_fp32_groups for p in group]
        return [param.grad.data for param in main_params if param.grad is not None]

    def _copy_model_grads_to_main_grads(self) -> None:
        as_is = self._main_grads_as_is()
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if hasattr(model_param, "main_grad"):
                    # DDP's grad buffer: with fp32 `.float()` is a no-op view, so unscale and clip act on it.
                    take_grad(main_param, model_param.main_grad, as_is)
                elif model_param.grad is not None:
                    main_param.grad = model_param.grad.float()
                model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for model_param in group:
                if hasattr(model_param, "main_grad"):
                    model_param.grad = model_param.main_grad

    def _main_to_model_params(self) -> dict:
        return {
            main_param: model_param
            for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups)
            for model_param, main_param in zip(model_group, main_group)
        }

    def _model_and_main_params(self):
        """(model params, main params) of the bf16/fp16 params (not those stored in FP8)."""
        pairs = [(model, main) for main, model in self._main_to_model_params().items() if not is_fp8_param(model)]
        return [model.data for model, _ in pairs], [main.data for _, main in pairs]

    def _fp8_params_and_mains(self):
        """(model params stored in FP8, their main params)."""
        pairs = [(model, main) for main, model in self._main_to_model_params().items() if is_fp8_param(model)]
        return [model for model, _ in pairs], [main for _, main in pairs]

    def _copy_main_params_to_model_params(self) -> None:
        model_params, main_params = self._model_and_main_params()
        if model_params:
            torch._foreach_copy_(model_params, main_params)
        self._copy_main_params_to_fp8_params()

    def _copy_main_params_to_fp8_params(self) -> None:
        cast_into_fp8_params(*self._fp8_params_and_mains())

    def _copy_model_params_to_main_params(self) -> None:
        model_params, main_params = self._model_and_main_params()
        if model_params:
            torch._foreach_copy_(main_params, model_params)
        for param, main_param in zip(*self._fp8_params_and_mains()):
            main_param.copy_(dequantize_fp8_param(param))

    def state_dict(self) -> dict:
        """Inner optimizer state, grad scaler state and the fp32 main params (the live tensors, not copies:
        serialise the dict before the next step)."""
        state_dict = {"optimizer": self.optimizer.state_dict(), "fp32_from_fp16_params": self.fp32_from_float16_groups}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        # Older Megatron checkpoints used 'optimizer_state_dict' and 'fp32_from_fp16'.
        optimizer_state = state_dict["optimizer" if "optimizer" in state_dict else "optimizer_state_dict"]
        order = reorder_saved_param_groups(self.optimizer.param_groups, optimizer_state["param_groups"])
        main_params_key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        saved_main_params = state_dict[main_params_key]
        optimizer_state = dict(optimizer_state, param_groups=[optimizer_state["param_groups"][i] for i in order])
        self.optimizer.load_state_dict(optimizer_state)
        self._load_grad_scaler_state(state_dict)

        for current_group, saved_index in zip(self.fp32_from_float16_groups, order):
            saved_group = saved_main_params[saved_index]
            if len(saved_group) != len(current_group):
                raise ValueError(
                    f"checkpoint param group {saved_index} has {len(saved_group)} fp32 main params, the model "
                    f"has {len(current_group)}: the checkpoint was written for a different model"
                )
            for current_param, saved_param in zip(current_group, saved_group):
                current_param.data.copy_(saved_param.data)


class FP32Optimizer(MegatronOptimizer):
    """Plain fp32 training: the inner optimizer updates the model params; gradients come from `main_grad`."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.optimizer.param_groups:
            _zero_grads(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._no_loss_scale()

    def scales_loss(self) -> bool:
        return False

    @torch.no_grad()
    def prepare_main_grads(self) -> bool:
        with self._timed("optimizer-copy-to-main-grad"):
            for param in self.get_parameters():
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad
        return False

    @torch.no_grad()
    def step_with_ready_grads(self, skip: Optional[torch.Tensor] = None) -> bool:
        if skip is not None:
            raise ValueError("FP32Optimizer cannot skip an update on the device")
        with self._timed("optimizer-inner-step"):
            self.optimizer.step()
        return True

    def reload_model_params(self) -> None:
        return None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        # A distributed optimizer's state nests its param groups (without params) under "optimizer": the
        # reordering below then says so.
        saved_groups = state_dict.get("param_groups") or state_dict.get("optimizer", {}).get("param_groups", [])
        order = reorder_saved_param_groups(self.optimizer.param_groups, saved_groups)
        self.optimizer.load_state_dict(dict(state_dict, param_groups=[state_dict["param_groups"][i] for i in order]))
