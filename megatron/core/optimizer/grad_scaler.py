"""Loss scalers for fp16 training: a constant one (`--loss-scale`) and Megatron's dynamic one.

The loss is multiplied by `scale` before backward so small fp16 gradients do not flush to zero; the
optimizer multiplies the fp32 main gradients by `inv_scale` before the update.
"""

from abc import ABC, abstractmethod
from typing import Optional

import torch


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class MegatronGradScaler(ABC):
    """Holds the loss scale as a 1-element fp32 tensor on the device of the gradients."""

    def __init__(self, initial_scale: float, device: Optional[torch.device] = None):
        if initial_scale <= 0.0:
            raise ValueError(f"the initial loss scale must be positive, got {initial_scale}")
        self.device = torch.device(device) if device is not None else _default_device()
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float, device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # 1/scale computed in fp64: scales up to 2^32 and down to 1 are exact powers of two either way,
        # but a user-chosen static scale is not.
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjusts the scale after a step; `found_inf` says whether any gradient overflowed."""

    @abstractmethod
    def state_dict(self) -> dict:
        """The scaler's state for a checkpoint."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the state written by `state_dict`."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (`--loss-scale`): overflowing steps are skipped but the scale never moves."""

    def update(self, found_inf: bool) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale with hysteresis.

    Every overflowing step resets the growth count and uses up one unit of hysteresis; once
    `hysteresis` overflows have accumulated (they need not be consecutive, only a growth resets the
    budget), each further overflow multiplies the scale by `backoff_factor`, never below `min_scale`.
    After `growth_interval` consecutive clean steps the scale is multiplied by `growth_factor` and the
    hysteresis budget is refilled.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: Optional[torch.device] = None,
    ):
        super().__init__(initial_scale, device)
        problems = []
        if not 0.0 < min_scale <= initial_scale:
            problems.append(
                f"min loss scale must be in (0, initial loss scale {initial_scale}], got {min_scale} "
                "(--min-loss-scale / --initial-loss-scale)"
            )
        if growth_factor <= 1.0:
            problems.append(f"growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            problems.append(f"backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            problems.append(f"loss scale window must be positive, got {growth_interval} (--loss-scale-window)")
        if hysteresis <= 0:
            problems.append(f"hysteresis must be positive, got {hysteresis} (--hysteresis)")
        if problems:
            raise ValueError("invalid dynamic loss scaling: " + "; ".join(problems))
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float, device=self.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float, device=self.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float, device=self.device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = state_dict["scale"].to(device=self.device, dtype=torch.float)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]
