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


class CheckpointWithoutOutput:
    """Runs a function whose outputs the next operation saves for its own backward, and lets the outputs'
    memory go (Megatron-Core's output-discarding recompute: selective recompute of "layernorm", "moe_act",
    "mla_up_proj"):

        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(norm, x)            # y computed without an autograd graph; x kept
        z = linear(y)                           # the consumer saves y
        ckpt.discard_output_and_register_recompute(z)   # y's storage freed

    When backward reaches `z` (its gradient is computed, before the consumer's backward needs y), the function
    runs again from the kept inputs, with the forward's RNG states, and its outputs are written into y's
    (re-allocated) storage, which every tensor that saved y shares; the gradient then flows through the
    recomputed graph to the inputs. Outputs that share storage with an input, or that are not plain
    contiguous tensors, are kept instead of discarded (there is nothing to save, or no storage to refill).
    """

    def __init__(self):
        self.function, self.outputs, self.ctx, self.rng_states = None, None, None, None
        self.input_storages = set()

    def checkpoint(self, function, *args):
        """`function(*args)` (one tensor or a tuple of tensors), to be discarded later."""
        self.function = function
        self.rng_states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized()
                           else None, get_cuda_rng_tracker().get_states())
        outputs = _OutputDiscardingFunction.apply(self, *args)
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Frees the outputs' storage; they are recomputed when backward computes `hook_tensor`'s gradient."""
        for output in self.outputs:
            if (output.is_contiguous() and output.storage_offset() == 0
                    and output.untyped_storage().data_ptr() not in self.input_storages):
                output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        if self.ctx is None:  # already recomputed
            return
        cpu_state, cuda_states, tracker_states = self.rng_states
        inputs = [tensor.detach().requires_grad_(tensor.requires_grad) for tensor in self.ctx.saved_tensors]
        devices = list(range(len(cuda_states))) if cuda_states is not None else []
        with torch.random.fork_rng(devices=devices), _tracker_states(tracker_states), torch.enable_grad():
            torch.set_rng_state(cpu_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
            recomputed = self.function(*inputs)
        recomputed = recomputed if isinstance(recomputed, tuple) else (recomputed,)
        for output, new in zip(self.outputs, recomputed):
            storage = output.untyped_storage()
            if storage.nbytes() == 0:  # discarded: refill in place (no version bump for the tensors saving it)
                storage.resize_(new.untyped_storage().nbytes())
                storage.copy_(new.contiguous().untyped_storage())
        self.ctx.recomputed = (inputs, recomputed)
        self.function, self.outputs, self.ctx, self.rng_states = None, None, None, None


class _OutputDiscardingFunction(torch.autograd.Function):
    """The forward of `CheckpointWithoutOutput`: outputs without a graph, inputs saved; backward through the
    graph its recompute hook built."""

    @staticmethod
    def forward(ctx, checkpoint, *args):
        with torch.no_grad():
            outputs = checkpoint.function(*args)
        # The inputs' storages, read here: reading ctx.saved_tensors later would unpack them (and reload
        # offloaded ones, activation_offload.py) in the forward pass.
        checkpoint.input_storages = {arg.untyped_storage().data_ptr() for arg in args if torch.is_tensor(arg)}
        ctx.save_for_backward(*args)
        checkpoint.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs, outputs = ctx.recomputed
        pairs = [(output, grad) for output, grad in zip(outputs, grads) if grad is not None and output.requires_grad]
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
        ctx.recomputed = None
        return (None, *(tensor.grad if tensor.requires_grad else None for tensor in inputs))
