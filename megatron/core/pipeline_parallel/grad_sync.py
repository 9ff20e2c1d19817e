"""When the data-parallel gradient reduction may run during a schedule, and finishing the gradients after it.

Gradients accumulate over the microbatches of a step; reducing them over DP after every microbatch would
waste bandwidth, so the schedules run backward inside the DDP `no_sync` context(s) and leave it only
for the last microbatch (of each chunk), whose backward may then launch the (bucketed) reduction.
`finalize_model_grads` completes it afterwards.
"""

import contextlib

import torch

from megatron.core import parallel_state
from megatron.core.fp8.scaling import update_fp8_scaling


class GradSyncSwitch:
    """Enters / leaves `config.no_sync_func`: one context manager factory, or one per model chunk."""

    def __init__(self, config):
        no_sync = config.no_sync_func
        if isinstance(no_sync, (list, tuple)):
            factories = list(no_sync)
            self._factory = lambda: _all_of(factories)
        else:
            self._factory = no_sync or contextlib.nullcontext
        self._context = None

    def disable(self) -> None:
        """Gradients only accumulate from now on."""
        if self._context is None:
            self._context = self._factory()
            self._context.__enter__()

    def enable(self) -> None:
        """The next backward may launch the gradient reduction."""
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


def _all_of(factories) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for factory in factories:
        stack.enter_context(factory())
    return stack


def new_token_count() -> torch.Tensor:
    """A zero count of loss tokens, where finalize_model_grads' collectives need it."""
    return torch.zeros((), dtype=torch.int, device=parallel_state.collective_device())


def finalize_gradients(config, model_chunks: list, total_num_tokens: torch.Tensor) -> None:
    """`config.finalize_model_grads_func(chunks, tokens)`; the global token count is passed only with
    calculate_per_token_loss (then all gradients are divided by it). With FP8 the delayed scales are
    updated from this step's amaxes first (megatron/core/fp8/scaling.py)."""
    if getattr(config, "fp8", None) is not None:
        update_fp8_scaling(model_chunks)
    if config.finalize_model_grads_func is None:
        return
    config.finalize_model_grads_func(model_chunks, total_num_tokens if config.calculate_per_token_loss else None)
