"""The CUDA-graph flags: Megatron-LM's spellings map to --cuda-graph-impl, and what a full-iteration graph
cannot replay is refused with the reason."""

import pytest
import torch

from megatron.training.arguments.validate_cuda_graph import check_cuda_graph

from .conftest import MINIMAL


@pytest.fixture
def cuda_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("flags", [
    ["--cuda-graph-impl", "full_iteration"],
    ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
    ["--enable-cuda-graph", "--cuda-graph-scope", "full_iteration"],
])
def test_megatron_spellings_of_the_full_iteration_graph(flags, validated, cuda_present):
    args = validated(*MINIMAL, "--bf16", "--attention-dropout", "0", *flags)
    assert args.cuda_graph_impl == "full_iteration" and args.cuda_graph_warmup_steps == 3


@pytest.mark.parametrize("flags, expected", [
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl local: per-layer CUDA graphs are not supported yet"),
    (["--enable-cuda-graph"], "--cuda-graph-impl local: per-layer CUDA graphs are not supported yet"),
    (["--cuda-graph-impl", "full_iteration", "--cuda-graph-modules", "attn"], "--cuda-graph-modules attn must be empty"),
    (["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "0"], "must be at least 1"),
    (["--cuda-graph-impl", "full_iteration", "--attention-dropout", "0.1"], "with --attention-dropout 0.1"),
    (["--cuda-graph-impl", "full_iteration", "--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8"],
     "with --rampup-batch-size"),
    (["--cuda-graph-impl", "full_iteration", "--recompute-activations"], "with --recompute-granularity selective"),
    (["--cuda-graph-impl", "full_iteration", "--num-experts", "4"], "with --num-experts"),
])
def test_refusals(flags, expected, problems, cuda_present):
    assert expected in problems(*MINIMAL, "--bf16", "--attention-dropout", "0", *flags)


@pytest.mark.parametrize("sizes, expected", [
    ({"world_size": 2}, ["data-parallel size 2 (world size 2)"]),
    ({"world_size": 2, "tensor_model_parallel_size": 2}, []),
    ({"world_size": 2, "tensor_model_parallel_size": 2, "hidden_dropout": 0.1},
     ["--hidden-dropout 0.1 at --tensor-model-parallel-size 2"]),
    ({"world_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True, "tp_comm_overlap": True}, []),
    ({"world_size": 2, "pipeline_model_parallel_size": 2}, ["--pipeline-model-parallel-size 2"]),
    ({"world_size": 2, "context_parallel_size": 2}, ["--context-parallel-size 2"]),
])
def test_tensor_parallelism_alone_is_replayed(sizes, expected, validated, cuda_present):
    """Tensor-parallel collectives are replayed from the graph; every other kind of parallelism is refused."""
    args = validated(*MINIMAL, "--attention-dropout", "0", "--hidden-dropout", "0")
    args.cuda_graph_impl = "full_iteration"
    for key, value in sizes.items():
        setattr(args, key, value)
    found = []
    check_cuda_graph(args, found)
    assert len(found) == len(expected) and all(
        problem.startswith(f"--cuda-graph-impl full_iteration is not supported yet with {reason}")
        for problem, reason in zip(found, expected)), found


def test_needs_a_gpu(problems, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--cuda-graph-impl full_iteration needs a CUDA device" in problems(*MINIMAL, "--cuda-graph-impl",
                                                                             "full_iteration")
