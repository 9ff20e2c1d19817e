"""One CUDA graph for the forward and backward passes of a whole training iteration (Megatron-Core's
`FullCudaGraphWrapper`, `--cuda-graph-impl full_iteration`).

A small model is host-bound: Python, autograd and the launches of ~1,500 kernels take longer than the
kernels themselves, and the GPU idles in between. Captured once, the iteration's kernels are replayed by a
single launch, so the GPU runs them back to back while the host prepares the next batch and the optimizer.

    call 1 .. warmup_steps      eager, on the capture stream (lazy initialisation: cuBLAS workspaces,
                                torch.compile, FP8 kernels, autograd's streams)
    call warmup_steps + 1       capture (which computes nothing), then replay: that iteration's result
    later calls                 copy the micro batches into the static input buffers, replay

Each call first reads all `num_microbatches` batches from the data iterator (on the host, as before) and
copies them into static device buffers, one set per micro batch; the wrapped schedule reads its batches
from those. The returned loss reports are the graph's static outputs: they hold this iteration's values
until the next replay, so read them (or reduce them into new tensors) before the next call, as the
training loop does. Evaluation (`forward_only=True`) runs eagerly.

What the captured region may not do, and why the training layer checks it up front: read a device value on the
host (`.item()`, a data-dependent shape: MoE token routing), swap generator states (the attention dropout's
per-rank stream, activation recomputation's RNG replay), change shape between iterations (a batch-size ramp-up
changes the micro batch count), or talk to other ranks except through collectives on the compute stream:
tensor parallelism's all-reduces, all-gathers, reduce-scatters and its batch broadcast are captured and
replayed (NCCL kernels), as are --tp-comm-overlap's collectives on side streams forked from and joined to the
compute stream (symmetric memory's fused ops, or chunked NCCL transfers); data-parallel gradient buckets and
pipeline sends are host-driven.
"""

import logging

import torch

from megatron.core.pipeline_parallel.microbatch_step import get_model_config

logger = logging.getLogger(__name__)


class FullCudaGraphWrapper:
    """Wraps `forward_backward_func` (a schedule of pipeline_parallel.schedules) for training iterations
    replayed from one CUDA graph; see the module docstring. Call it with the schedule's keyword arguments."""

    def __init__(self, forward_backward_func, cuda_graph_warmup_steps: int = 3):
        if cuda_graph_warmup_steps < 1:
            raise ValueError(f"cuda_graph_warmup_steps must be at least 1 (lazy initialisation happens in eager "
                             f"steps), got {cuda_graph_warmup_steps}")
        self.forward_backward_func = forward_backward_func
        self.warmup_steps = cuda_graph_warmup_steps
        self.graph = None
        self.result = None
        self.training_calls = 0
        self._static_batches = []
        self._stream = None
        self._shape = None

    def __call__(self, **kwargs):
        if kwargs.get("forward_only"):
            return self.forward_backward_func(**kwargs)
        model = kwargs["model"]
        chunks = model if isinstance(model, list) else [model]
        if len(chunks) != 1:
            raise ValueError("full-iteration CUDA graphs take one model chunk (no virtual pipeline stages)")
        shape = (kwargs["num_microbatches"], kwargs.get("seq_length"), kwargs.get("micro_batch_size"))
        if self._shape is not None and shape != self._shape:
            raise ValueError(f"full-iteration CUDA graph captured for (micro batches, sequence length, micro batch "
                             f"size) = {self._shape}, called with {shape}: the shapes of a captured iteration "
                             "cannot change")
        self._shape = shape
        kwargs["data_iterator"] = iter(self._load_static_batches(kwargs["data_iterator"], shape[0]))
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self.training_calls += 1
        if self.graph is not None:
            self.graph.replay()
        elif self.training_calls <= self.warmup_steps:
            self.result = self._on_capture_stream(lambda: self.forward_backward_func(**kwargs))
        else:
            self._capture(kwargs)
            self.graph.replay()
        return self.result

    def _load_static_batches(self, data_iterator, num_microbatches: int) -> list:
        """Reads the iteration's micro batches and copies them into the static buffers (same shapes every
        iteration); ranks without data (no iterator) get an empty list, as their schedule reads nothing."""
        if isinstance(data_iterator, list):
            if len(data_iterator) != 1:
                raise ValueError("full-iteration CUDA graphs take one data iterator")
            data_iterator = data_iterator[0]
        if data_iterator is None:
            return []
        for index in range(num_microbatches):
            batch = next(data_iterator)
            if not isinstance(batch, dict):
                raise ValueError(f"full-iteration CUDA graphs need batches that are dicts of tensors, got "
                                 f"{type(batch).__name__}")
            if index == len(self._static_batches):
                self._static_batches.append(
                    {key: value.to("cuda", copy=True) if torch.is_tensor(value) else value
                     for key, value in batch.items()}
                )
                continue
            static = self._static_batches[index]
            for key, value in batch.items():
                if not torch.is_tensor(value):
                    static[key] = value
                    continue
                target = static.get(key)
                if target is None or target.shape != value.shape or target.dtype != value.dtype:
                    raise ValueError(
                        f"micro batch {index} of this iteration has {key} {value.dtype} {tuple(value.shape)}, the "
                        f"captured iteration had {None if target is None else (target.dtype, tuple(target.shape))}: "
                        "a full-iteration CUDA graph replays fixed shapes"
                    )
                target.copy_(value, non_blocking=True)
        return self._static_batches[:num_microbatches]

    def _on_capture_stream(self, function):
        """Runs `function` on the side stream the graph is captured on (so that lazily created per-stream
        state, e.g. cuBLAS workspaces, exists for it), ordered after and before the current stream's work."""
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            result = function()
        torch.cuda.current_stream().wait_stream(self._stream)
        return result

    def _capture(self, kwargs) -> None:
        model = kwargs["model"]
        config = get_model_config(model[0] if isinstance(model, list) else model)
        # Timers synchronise the device, which a capture may not; the captured pieces are not timed anyway.
        timers, config.timers = config.timers, None
        torch.cuda.synchronize()
        # The eager warm-up's activations are cached by the allocator; release them so that the graph's
        # private memory pool does not come on top of them.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self.result = self.forward_backward_func(**kwargs)
        except RuntimeError as error:
            raise RuntimeError(
                f"capturing the training iteration in a CUDA graph failed ({error}); run without "
                "--cuda-graph-impl full_iteration (something in the forward or backward pass reads a device "
                "value on the host or needs the host between kernels)"
            ) from error
        finally:
            config.timers = timers
        torch.cuda.synchronize()
        self.graph = graph
        logger.info("captured the training iteration in a CUDA graph after %d eager iterations", self.warmup_steps)

