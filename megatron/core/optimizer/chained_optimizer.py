"""`ChainedOptimizer`: several Megatron optimizers stepped as one (dense params + expert-parallel params).

The sub-optimizers reduce their gradient statistics over different groups (model-parallel vs expert
tensor x expert x pipeline), so each computes its own fully reduced norm and the global norm is

    ||g|| = sqrt( sum over sub-optimizers i of ||g_i||^2 ),

which all of them then clip against. An overflow in any sub-optimizer skips the whole step and
backs off every loss scaler.
"""

import math
from typing import List, Optional

import torch

from .optimizer import MegatronOptimizer


class ChainedOptimizer(MegatronOptimizer):
    """Steps `chained_optimizers` together; `state_dict` is a list with one entry per sub-optimizer."""

    def __init__(self, chained_optimizers: List[MegatronOptimizer]):
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.chained_optimizers = chained_optimizers
        for optimizer in chained_optimizers:
            optimizer.chained = True
        self.config = chained_optimizers[0].config
        self.grad_stats_parallel_group = None
        self.tensor_parallel_rank = None

    @property
    def param_groups(self) -> List[dict]:
        return [group for optimizer in self.chained_optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        raise AttributeError(
            "ChainedOptimizer has one state per sub-optimizer: read chained_optimizers[i].state instead"
        )

    def get_parameters(self) -> List[torch.nn.Parameter]:
        return [param for optimizer in self.chained_optimizers for param in optimizer.get_parameters()]

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return math.sqrt(sum(optimizer.get_grad_norm() ** 2 for optimizer in self.chained_optimizers))

    @torch.no_grad()
    def get_params_norm(self) -> float:
        return math.sqrt(sum(optimizer.get_params_norm() ** 2 for optimizer in self.chained_optimizers))

    @torch.no_grad()
    def count_zeros(self) -> int:
        return sum(optimizer.count_zeros() for optimizer in self.chained_optimizers)

    @torch.no_grad()
    def prepare_main_grads(self) -> bool:
        # Every sub-optimizer must prepare its grads, so no short-circuiting `any(generator)`.
        return any([optimizer.prepare_main_grads() for optimizer in self.chained_optimizers])

    def update_loss_scale(self, found_inf: bool) -> None:
        # All loss scalers see the same combined flag, so they stay equal to the scale of the loss.
        for optimizer in self.chained_optimizers:
            optimizer.update_loss_scale(found_inf)

    @torch.no_grad()
    def step_with_ready_grads(self, skip=None) -> bool:
        return all([optimizer.step_with_ready_grads(skip) for optimizer in self.chained_optimizers])

    def supports_device_veto(self) -> bool:
        return all(optimizer.supports_device_veto() for optimizer in self.chained_optimizers)

    def rewind_vetoed_update(self) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.rewind_vetoed_update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.chained_optimizers[0].get_loss_scale()

    def scales_loss(self) -> bool:
        return self.chained_optimizers[0].scales_loss()

    def reload_model_params(self) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.reload_model_params()

    def refresh_fp8_params(self) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.refresh_fp8_params()

    def state_dict(self) -> list:
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def get_parameter_state_dp_zero(self) -> list:
        """The distributed optimizers' gathered param states, one entry per sub-optimizer (None for a
        sub-optimizer that is not distributed), as Megatron's `distrib_optim.pt` of a chained optimizer."""
        return [
            optimizer.get_parameter_state_dp_zero() if hasattr(optimizer, "get_parameter_state_dp_zero") else None
            for optimizer in self.chained_optimizers
        ]

    def load_parameter_state_from_dp_zero(self, state_dict: Optional[list]) -> None:
        """Scatters `get_parameter_state_dp_zero()` output (given on data-parallel rank 0, None elsewhere)."""
        for index, optimizer in enumerate(self.chained_optimizers):
            if hasattr(optimizer, "load_parameter_state_from_dp_zero"):
                # An entry missing on rank 0 becomes None, which the sub-optimizer reports on every rank.
                saved = state_dict[index] if state_dict is not None and index < len(state_dict) else None
                optimizer.load_parameter_state_from_dp_zero(saved)

    def load_state_dict(self, state_dict: list) -> None:
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(
                f"the checkpoint holds {len(state_dict)} optimizer states, this run has "
                f"{len(self.chained_optimizers)} (dense and expert-parallel parameters have one each)"
            )
        for optimizer, optimizer_state in zip(self.chained_optimizers, state_dict):
            optimizer.load_state_dict(optimizer_state)
