"""A few training steps under `torch.profiler`, summarised as kernel classes (the throughput benchmark's
`--profile`).

The summary says where a step's GPU time goes - GEMMs, attention, Triton (torch.compile / our fused
kernels), other elementwise/reduction kernels, copies - and how busy the GPU is: kernel time / wall time
well below 1 means the host (Python, launches, syncs) is the bottleneck, not the kernels.
"""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install
from megatron.training.profiling import summarize_kernels  # noqa: E402


def profile_steps(step_fn, steps: int, table_path: str, title: str) -> str:
    """Runs `step_fn` `steps` times under the profiler; writes the top-kernel table to `table_path`, the
    timeline with input shapes beside it (`<table_path>.trace.json.gz`, for chrome://tracing or Perfetto: where
    the GPU idles and what the host does meanwhile) and returns a one-paragraph summary (ms per step per kernel
    class, GPU busy fraction)."""
    step_fn()  # the first step after a pause may allocate; keep it out of the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    prof.export_chrome_trace(f"{table_path}.trace.json.gz")
    with open(table_path, "w") as table:
        table.write(f"{title}: {steps} steps\n")
        table.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90))
    return summarize_kernels(prof, steps, wall_ms, title)
