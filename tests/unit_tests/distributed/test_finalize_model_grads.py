"""finalize_model_grads: TP sums of sequence-parallel norm grads, tied-embedding sums across pipeline
stages and the per-token division, each checked against sums worked out by hand (rank r holds r + 1)."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.fsdp.sharded_grads import ShardedGradDataParallel
from tests.unit_tests.dist_utils import run_distributed


def _wrap(module, **config):
    settings = {"calculate_per_token_loss": False, "qk_layernorm": False, **config}
    ddp = DistributedDataParallel(SimpleNamespace(**settings), DistributedDataParallelConfig(), module)
    for param in module.parameters():
        param.main_grad.fill_(float(torch.distributed.get_rank() + 1))
    return ddp


def _grads(ddp):
    return {name: param.main_grad.unique().tolist() for name, param in ddp.module.named_parameters()}


def _tensor_parallel_norms():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    module = torch.nn.Module()
    module.norm = torch.nn.LayerNorm(4)
    module.norm.weight.sequence_parallel = True
    module.q_layernorm = torch.nn.LayerNorm(4, bias=False)
    module.linear = torch.nn.Linear(4, 4, bias=False)
    module.linear.weight.tensor_model_parallel = True
    ddp = _wrap(module, qk_layernorm=True)
    finalize_model_grads([ddp])
    mine = float(torch.distributed.get_rank() + 1)
    expected = {"norm.weight": [3.0], "norm.bias": [mine], "q_layernorm.weight": [3.0], "linear.weight": [mine]}
    assert _grads(ddp) == expected, _grads(ddp)


def _tied_embeddings_across_stages():
    # Both stages hold position embeddings too (an encoder-decoder split), so they are summed as well.
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, get_position_embedding_ranks=lambda pipeline_ranks: pipeline_ranks
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    module = torch.nn.Module()
    module.tied = torch.nn.Linear(4, 4, bias=False)  # word embedding on stage 0, output layer on stage 1
    module.tied.weight.shared_embedding = True
    module.tied.weight.shared = stage == 1
    module.position_embeddings = torch.nn.Embedding(3, 4)
    module.other = torch.nn.Linear(4, 2, bias=False)
    ddp = _wrap(module)
    num_tokens = torch.tensor(7 if stage == 1 else 0)  # only the last stage knows the token count
    finalize_model_grads([ddp], num_tokens=num_tokens)
    assert num_tokens.item() == 7
    assert _grads(ddp) == {
        "tied.weight": [pytest.approx(3.0 / 7)],
        "position_embeddings.weight": [pytest.approx(3.0 / 7)],
        "other.weight": [pytest.approx((stage + 1) / 7)],
    }
    # Sharded gradients shard the position embeddings differently on each stage: refused.
    sharded_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    settings = SimpleNamespace(calculate_per_token_loss=False, qk_layernorm=False)
    module = torch.nn.Module()
    module.position_embeddings = torch.nn.Embedding(3, 4)
    with pytest.raises(ValueError, match="optim_grads: position embeddings held by several pipeline stages are not supported yet"):
        ShardedGradDataParallel(settings, sharded_config, module)


def _per_token_division_over_data_parallel_ranks():
    parallel_state.initialize_model_parallel()
    module = torch.nn.Linear(4, 4, bias=False)
    ddp = _wrap(module, calculate_per_token_loss=True)  # gradients are summed, not averaged, over DP
    num_tokens = torch.tensor(3 + torch.distributed.get_rank())
    finalize_model_grads([ddp], num_tokens=num_tokens)
    assert num_tokens.item() == 7
    assert _grads(ddp) == {"weight": [pytest.approx(3.0 / 7)]}


def _all_checks(rank, world_size):
    _tensor_parallel_norms()
    _tied_embeddings_across_stages()
    _per_token_division_over_data_parallel_ranks()


def test_finalize_model_grads_on_two_ranks():
    # Three parallel layouts in one spawn: starting ranks costs seconds on a 2-core machine.
    run_distributed(_all_checks, 2)
