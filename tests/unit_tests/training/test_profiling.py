"""The loop's profiling and garbage-collection flags (megatron/training/profiling.py)."""

import gc
import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from megatron.training import profiling
from megatron.training.arguments import parse_args, validate_args


def _args(**overrides):
    values = dict(profile=False, use_pytorch_profiler=False, profile_step_start=2, profile_step_end=4,
                  profile_ranks=[], tensorboard_dir=None, manual_gc=False, manual_gc_interval=0,
                  manual_gc_eval=True, pytorch_profiler_collect_shapes=False,
                  pytorch_profiler_collect_callstack=False)
    values.update(overrides)
    return SimpleNamespace(**values)


def _run_loop(instrumentation, iterations: int, work=lambda: None):
    for iteration in range(1, iterations + 1):
        instrumentation.before_iteration(iteration)
        work()
        instrumentation.after_iteration(iteration)
    instrumentation.finish()


def test_pytorch_profiler_covers_iterations_start_to_end_minus_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _args(profile=True, use_pytorch_profiler=True, tensorboard_dir=str(tmp_path / "tb"))
    instrumentation = profiling.LoopInstrumentation(args)
    seen = []

    def work():
        seen.append(instrumentation.torch_profiler is not None)
        torch.ones(4).sum()

    _run_loop(instrumentation, 6, work)
    assert seen == [False, True, True, False, False, False]
    assert (tmp_path / "torch_profile" / "rank-0.json.gz").exists()
    assert "profile of iterations 2-3, rank 0" in capsys.readouterr().out


@pytest.mark.parametrize("collect", [False, True])
def test_pytorch_profiler_collects_shapes_and_call_stacks_on_request(tmp_path, monkeypatch, collect):
    """--pytorch-profiler-collect-shapes / -callstack: the trace's ops carry input shapes and the Python lines
    that called them (Megatron-LM's flags)."""
    monkeypatch.chdir(tmp_path)
    instrumentation = profiling.LoopInstrumentation(_args(profile=True, use_pytorch_profiler=True,
                                                          pytorch_profiler_collect_shapes=collect,
                                                          pytorch_profiler_collect_callstack=collect))
    _run_loop(instrumentation, 4, lambda: torch.ones(4, 3).sum())
    with gzip.open(tmp_path / "torch_profile" / "rank-0.json.gz", "rt") as trace:
        events = json.load(trace)["traceEvents"]
    sums = [event for event in events if event.get("name") == "aten::sum"]
    assert sums and all(("Input Dims" in event.get("args", {})) is collect for event in sums)
    assert any(event.get("cat") == "python_function" for event in events) is collect


def test_profiling_stops_when_the_loop_ends_inside_the_window(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    instrumentation = profiling.LoopInstrumentation(_args(profile=True, use_pytorch_profiler=True,
                                                          profile_step_end=10))
    _run_loop(instrumentation, 3)
    assert instrumentation.torch_profiler is None
    assert (tmp_path / "torch_profile" / "rank-0.json.gz").exists()


def test_other_ranks_are_not_profiled():
    instrumentation = profiling.LoopInstrumentation(_args(profile=True, use_pytorch_profiler=True,
                                                          profile_ranks=[3]))
    assert not instrumentation.profiling


def test_manual_gc_disables_the_collector_and_collects_on_schedule(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    instrumentation = profiling.LoopInstrumentation(_args(manual_gc=True, manual_gc_interval=3))
    try:
        assert not gc.isenabled()
        assert calls == [2]  # the start-up collection
        for iteration in range(1, 8):
            instrumentation.after_iteration(iteration)
        assert calls == [2, 2, 2]  # after iterations 3 and 6
        with instrumentation.evaluation():
            pass
        assert calls == [2, 2, 2, 2, 0]
    finally:
        instrumentation.finish()
    assert gc.isenabled()


def test_kernel_classes():
    assert profiling.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert profiling.kernel_class("pytorch_flash::flash_fwd_kernel") == "attention"
    assert profiling.kernel_class("triton_per_fused_native_layer_norm_0") == "triton"
    assert profiling.kernel_class("_adamw_kernel") == "optimizer"
    assert profiling.kernel_class("void at::native::elementwise_kernel") == "other"


@pytest.mark.parametrize("flags, message", [
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], "--profile-step-end 5 must be above"),
    (["--manual-gc-interval", "-1"], "--manual-gc-interval -1 must be >= 0"),
])
def test_bad_profiling_flags(flags, message):
    args = parse_args(args_list=[
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", *flags])
    with pytest.raises(ValueError, match=message):
        validate_args(args)
