"""Named RNG streams for tensor parallelism, and activation recomputation that replays them.

Some randomness must be the same on every TP rank (dropout on replicated activations: the default
generator, seeded with `seed`) and some must differ per rank (dropout inside a TP-split region, the
init of a weight shard: the `model-parallel-rng` stream, seeded with `seed + 2718 + tp_rank`). The
tracker keeps those streams and swaps one into the device's default generator inside `fork()`.
"The device" is CUDA when it is available, else the CPU, so the same code runs on both.
"""

import contextlib

import torch
import torch.utils.checkpoint

from megatron.core import parallel_state
from megatron.core.model_parallel_config import reject_unsupported

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


def _get_device_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named RNG states of the device generator (CUDA, or the CPU when there is no GPU)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        # The seed each stream started from, and the default generator's (model_parallel_cuda_manual_seed):
        # what a checkpoint written on a CPU gives a GPU run that resumes it.
        self.stream_seeds: dict[str, int] = {}
        self.default_seed: int | None = None

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (saved in checkpoints)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Registers stream `name` starting from `seed`; the current device RNG state is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already used by another tracked stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        self.stream_seeds[name] = seed
        original = _get_device_rng_state()
        _device_manual_seed(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Runs the block with stream `name` as the device generator, then advances that stream."""
        if name not in self.states_:
            raise RuntimeError(
                f"RNG stream {name!r} is not set up: call "
                "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) first"
            )
        original = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide tracker."""
    return _CUDA_RNG_STATE_TRACKER


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(
    seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> None:
    """Seeds the device generator with `seed` and registers the per-rank streams (Megatron's offsets).

    default generator      seed                                        same on all TP ranks
    model-parallel-rng     seed + 2718 + tp_rank                        differs across TP ranks
    expert-parallel-rng    seed + 1024 + 100 * ep_rank + etp_rank
    data-parallel-rng      seed
    """
    reject_unsupported(
        "model_parallel_cuda_manual_seed",
        te_rng_tracker=te_rng_tracker,
        inference_rng_tracker=inference_rng_tracker,
        use_cudagraphable_rng=use_cudagraphable_rng,
    )
    tensor_parallel_seed = seed + 2718 + parallel_state.get_tensor_model_parallel_rank()
    expert_parallel_seed = (
        seed
        + 1024
        + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_expert_tensor_parallel_rank()
    )
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.default_seed = seed
    _device_manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


def model_parallel_rng_region():
    """Context for randomness that must differ between TP ranks (weight-shard init, attention dropout).

    Uses the `model-parallel-rng` stream once `model_parallel_cuda_manual_seed` has run. Without it, a
    single TP rank simply uses the default generator; several TP ranks would draw identical shards,
    which is an error.
    """
    tracker = get_cuda_rng_tracker()
    if _MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.states_:
        return tracker.fork(_MODEL_PARALLEL_RNG_TRACKER_NAME)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return contextlib.nullcontext()
    raise RuntimeError(
        "tensor parallelism needs a per-rank RNG stream: call "
        "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) before building the model "
        "(or set use_cpu_initialization=True and disable dropout)"
    )


@contextlib.contextmanager
def _tracker_states(states: dict[str, torch.Tensor]):
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(current)


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Runs `function(*args)` without keeping its activations; recomputes them during backward.

    The recomputation sees the same default-generator state (torch's `preserve_rng_state`) and the same
    tracker streams as the first run, so dropout masks repeat exactly and gradients equal those of a
    run without recompute.
    """
    if distribute_saved_activations:
        raise ValueError("distribute_saved_activations=True is not supported yet")
    states_at_forward = get_cuda_rng_tracker().get_states()

    def context_fn():
        return contextlib.nullcontext(), _tracker_states(states_at_forward)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn
    )
