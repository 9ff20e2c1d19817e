"""--deterministic-mode at start-up (library variables, torch's flag) and its embedding lookup."""

import argparse

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.training.determinism import apply_deterministic_mode


@pytest.fixture
def torch_flag():
    yield
    torch.use_deterministic_algorithms(False)


def test_start_up_fills_unset_variables_and_sets_torch_flag(torch_flag):
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    apply_deterministic_mode(argparse.Namespace(deterministic_mode=False), env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"} and not torch.are_deterministic_algorithms_enabled()
    apply_deterministic_mode(argparse.Namespace(deterministic_mode=True), env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert torch.are_deterministic_algorithms_enabled()


def test_deterministic_embedding_lookup_gives_the_same_values_and_gradients():
    ids = torch.tensor([[3, 1, 3, 7], [7, 7, 0, 3]])
    tables = []
    for deterministic in (False, True):
        torch.manual_seed(0)
        config = ModelParallelConfig(deterministic_mode=deterministic)
        embedding = VocabParallelEmbedding(10, 4, init_method=torch.nn.init.normal_, config=config)
        output = embedding(ids)
        (output * torch.arange(4.0)).sum().backward()
        tables.append((output.detach(), embedding.weight.grad))
    torch.testing.assert_close(tables[0][0], tables[1][0], rtol=0, atol=0)
    torch.testing.assert_close(tables[0][1], tables[1][1])
