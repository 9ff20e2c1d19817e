"""tools/bench/kernel_sources.py: kernels (and CPU ops) attributed to the Python lines that launched them."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
import kernel_sources  # noqa: E402


def _frame(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_kernels_are_summed_per_launching_stack():
    """Two fills launched from zero_unwritten_grads, one from elsewhere; a GEMM that does not match; a fill whose
    launch is missing from the trace (not counted)."""
    events = [
        _frame("pretrain_gpt.py(10): main", 0, 1000),
        _frame("megatron/core/distributed/param_and_grad_bucket.py(104): zero_unwritten_grads", 100, 100),
        _frame("megatron/core/optimizer/optimizer.py(50): step", 500, 100),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 110, "dur": 5, "tid": 1,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150, "dur": 5, "tid": 1,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 510, "dur": 5, "tid": 1,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 520, "dur": 5, "tid": 1,
         "args": {"correlation": 4}},
    ] + [{"ph": "X", "cat": "kernel", "name": name, "ts": 2000 + index, "dur": dur, "tid": 7,
          "args": {"correlation": correlation}}
         for index, (name, dur, correlation) in enumerate([
             ("FillFunctor<float>", 3.0, 1), ("FillFunctor<float>", 4.0, 2), ("FillFunctor<float>", 2.0, 3),
             ("nvjet_gemm", 50.0, 4), ("FillFunctor<float>", 9.0, 99)])]
    rows = kernel_sources.kernel_sources(events, "Fill", depth=2)
    assert rows == [
        (7.0, 2, ("pretrain_gpt.py(10): main",
                  "megatron/core/distributed/param_and_grad_bucket.py(104): zero_unwritten_grads")),
        (2.0, 1, ("pretrain_gpt.py(10): main", "megatron/core/optimizer/optimizer.py(50): step")),
    ]


def _sum_twice():
    torch.ones(3).sum()
    torch.ones(3).sum()


def test_cpu_ops_of_a_real_trace_name_the_function_that_ran_them(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as profiler:
        _sum_twice()
    path = str(tmp_path / "trace.json")
    profiler.export_chrome_trace(path)
    rows = kernel_sources.kernel_sources(kernel_sources.load_events(path), r"^aten::sum$", depth=8, cpu_ops=True)
    assert sum(count for _, count, _ in rows) >= 2  # aten::sum may call itself (the CPU kernel's dispatch)
    assert all(any("_sum_twice" in frame for frame in stack) for _, _, stack in rows)
