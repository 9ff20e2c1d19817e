"""--check-weight-hash-across-dp-replicas-interval on two data-parallel gloo ranks: equal replicas pass, a
replica with one changed weight stops both ranks naming the parameter and the rank."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.training.weight_hash import check_weight_hashes_across_dp_replicas
from tests.unit_tests.dist_utils import run_distributed


def _check(rank, world_size):
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)]
    check_weight_hashes_across_dp_replicas(model, iteration=10)
    if rank == 1:
        with torch.no_grad():
            model[0][1].bias[2] += 1.0
    with pytest.raises(RuntimeError) as error:
        check_weight_hashes_across_dp_replicas(model, iteration=20)
    return str(error.value)


def test_replicas_that_differ_stop_the_run():
    messages = run_distributed(_check, 2)
    assert messages[0] == messages[1] == (
        "--check-weight-hash-across-dp-replicas-interval: at iteration 20 the data-parallel replicas hold different "
        "weights:\n  - chunk 0 1.bias: global ranks [1] differ from rank 0")
