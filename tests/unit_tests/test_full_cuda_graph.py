"""megatron/core/full_cuda_graph.py: the full-iteration CUDA graph of a training step.

On the CPU a stand-in for `torch.cuda.graph` records the captured function and replays it by running it
again, which checks the wrapper's own logic: eager warm-up calls, one capture, the static input buffers
refilled in place each iteration, the captured outputs returned, evaluation left eager, shape changes
refused. On a GPU (`gpu` marker) pretrain_gpt.py trains the same tiny GPT with and without the graph and
the losses are compared.
"""

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.core import full_cuda_graph
from megatron.core.full_cuda_graph import FullCudaGraphWrapper

ROOT = __file__.rsplit("/tests/", 1)[0]


class _RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph. A real replay reruns the captured kernels, which rewrite the
    captured outputs in place from the static inputs; `replay` here reruns `rerun()` and copies its
    reports into the captured ones."""

    rerun = None
    captured_result = None

    def replay(self):
        for captured, fresh in zip(_RecordingGraph.captured_result(), _RecordingGraph.rerun()):
            captured["lm loss"].copy_(fresh["lm loss"])


@pytest.fixture
def cpu_graphs(monkeypatch):
    captures = []

    @contextlib.contextmanager
    def graph(cuda_graph, stream=None, capture_error_mode=None):
        captures.append(cuda_graph)
        yield

    cuda = full_cuda_graph.torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", _RecordingGraph)
    monkeypatch.setattr(cuda, "graph", graph)
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(cuda, "Stream", stream)
    monkeypatch.setattr(cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "current_stream", stream)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    # Static buffers go "to the device": the CPU here.
    original_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: original_to(
        self, *["cpu" if arg == "cuda" else arg for arg in args], **kwargs))
    yield captures
    _RecordingGraph.rerun = _RecordingGraph.captured_result = None


def _replaying(wrapper, kwargs):
    """Lets the stand-in graph of `wrapper` rerun its schedule on the static batches."""
    _RecordingGraph.rerun = lambda: wrapper.forward_backward_func(data_iterator=iter(wrapper._static_batches),
                                                                  **kwargs)
    _RecordingGraph.captured_result = lambda: wrapper.result


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"timers": "timers"})()


def _schedule(calls):
    """A schedule that records the tokens it saw and returns per-micro-batch reports computed from them."""

    def forward_backward(*, data_iterator, model, num_microbatches, seq_length, micro_batch_size, forward_only):
        reports = []
        for _ in range(num_microbatches):
            batch = next(data_iterator)
            calls.append((batch["tokens"].clone(), model.config.timers, forward_only))
            reports.append({"lm loss": batch["tokens"].float().sum().reshape(1)})
        return reports

    return forward_backward


def _data(start):
    step = start
    while True:
        yield {"tokens": torch.full((2, 3), step), "position_ids": torch.arange(3).repeat(2, 1)}
        step += 1


def test_warmup_capture_and_replays(cpu_graphs):
    calls = []
    wrapper = FullCudaGraphWrapper(_schedule(calls), cuda_graph_warmup_steps=2)
    data, model = _data(0), _Model()
    kwargs = dict(model=model, num_microbatches=2, seq_length=3, micro_batch_size=2, forward_only=False)
    _replaying(wrapper, kwargs)
    results = [wrapper(data_iterator=data, **kwargs) for _ in range(5)]
    assert len(cpu_graphs) == 1  # captured once, at the third call
    # After the capture every call returns the same (captured) report tensors, refilled by the replay.
    assert results[2] is results[3] is results[4] and results[1] is not results[2]
    # Each iteration's reports come from its own micro batches (0, 1 | 2, 3 | ... | 8, 9; 6 tokens each); the
    # last one is read after its call, as the training loop reads it before the next.
    assert [float(report["lm loss"]) for report in results[1]] == [12.0, 18.0]
    assert [float(report["lm loss"]) for report in results[4]] == [48.0, 54.0]
    # The capture ran the schedule with the timers off, and restored them afterwards.
    assert [timers for _, timers, _ in calls[:6]] == ["timers"] * 4 + [None] * 2
    assert model.config.timers == "timers"


def test_static_buffers_are_refilled_in_place(cpu_graphs):
    calls = []
    wrapper = FullCudaGraphWrapper(_schedule(calls), cuda_graph_warmup_steps=1)
    data = _data(0)
    kwargs = dict(model=_Model(), num_microbatches=1, seq_length=3, micro_batch_size=2, forward_only=False)
    _replaying(wrapper, kwargs)
    wrapper(data_iterator=data, **kwargs)
    buffer = wrapper._static_batches[0]["tokens"]
    wrapper(data_iterator=data, **kwargs)
    assert wrapper._static_batches[0]["tokens"] is buffer and int(buffer[0, 0]) == 1


def test_evaluation_stays_eager(cpu_graphs):
    calls = []
    wrapper = FullCudaGraphWrapper(_schedule(calls), cuda_graph_warmup_steps=1)
    for _ in range(3):
        wrapper(data_iterator=_data(7), model=_Model(), num_microbatches=1, seq_length=3, micro_batch_size=2,
                forward_only=True)
    assert not cpu_graphs and wrapper.training_calls == 0 and len(calls) == 3


def test_shape_changes_are_refused(cpu_graphs):
    wrapper = FullCudaGraphWrapper(_schedule([]), cuda_graph_warmup_steps=1)
    kwargs = dict(model=_Model(), seq_length=3, micro_batch_size=2, forward_only=False)
    wrapper(data_iterator=_data(0), num_microbatches=1, **kwargs)
    with pytest.raises(ValueError, match="cannot change"):
        wrapper(data_iterator=_data(0), num_microbatches=2, **kwargs)
    short = iter([{"tokens": torch.zeros(1, 3, dtype=torch.long), "position_ids": torch.zeros(1, 3)}])
    with pytest.raises(ValueError, match="replays fixed shapes"):
        wrapper(data_iterator=short, num_microbatches=1, **kwargs)


def test_at_least_one_warmup_step():
    with pytest.raises(ValueError, match="at least 1"):
        FullCudaGraphWrapper(lambda **kwargs: None, cuda_graph_warmup_steps=0)


_LOSS = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.E+-]+)")


def _losses(command: list[str], environment: dict | None = None) -> dict:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=None if environment is None else {**os.environ, **environment})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(step): float(loss) for step, loss in _LOSS.findall(done.stdout)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pretrain_gpt_with_the_graph_trains_like_eager():
    """bf16 tiny GPT, 12 iterations logged each: the graph (captured after 3 eager ones) replays the same
    kernels, so every loss equals the eager run's to the printed digits."""
    common = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-layers", "2",
              "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "256",
              "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "8",
              "--lr", "1e-3", "--train-iters", "12", "--log-interval", "1", "--eval-iters", "0", "--bf16",
              "--hidden-dropout", "0.1", "--attention-dropout", "0", "--num-workers", "0"]
    losses = {name: _losses([sys.executable, "pretrain_gpt.py", *common, *extra])
              for name, extra in (("eager", []), ("graph", ["--cuda-graph-impl", "full_iteration"]))}
    assert sorted(losses["graph"]) == list(range(1, 13))
    assert losses["graph"] == losses["eager"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("implementation", ["symmetric_memory", "chunked"])
def test_tensor_parallel_overlap_replays_like_eager(implementation):
    """TP=2 + SP + --tp-comm-overlap, bf16 tiny GPT, 12 iterations: the graph replays the overlap's side-stream
    collectives (symmetric memory's fused ops, or the chunked NCCL all-gathers and point-to-point partial
    sums), so every loss equals the eager run's to the printed digits."""
    common = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-layers", "2",
              "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
              "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "8",
              "--lr", "1e-3", "--train-iters", "12", "--log-interval", "1", "--eval-iters", "0", "--bf16",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
              "--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "pretrain_gpt.py"]
    environment = {"MEGATRON_TP_COMM_OVERLAP_IMPL": implementation, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    losses = {name: _losses(torchrun + common + extra, environment)
              for name, extra in (("eager", []), ("graph", ["--cuda-graph-impl", "full_iteration"]))}
    assert sorted(losses["graph"]) == list(range(1, 13))
    assert losses["graph"] == losses["eager"]
