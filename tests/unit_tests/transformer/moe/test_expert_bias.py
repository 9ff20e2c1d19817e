"""Aux-loss-free balancing end to end in one process: the routers count their tokens once per step (also
under full activation recompute, which replays the forward), finalize_model_grads moves each expert bias
by rate * sign(mean load - load) and zeroes the counts, and the bias is saved with the model."""

import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.distributed.conftest import single_rank_groups  # noqa: F401  (one gloo rank)

RATE, TOKENS, TOPK = 0.01, 2 * 8, 2


def _step(**recompute):
    # Both calls must build the same model and route the same tokens: the model-parallel RNG streams (which an
    # earlier test in this process may have seeded and advanced) are seeded too, not only torch's default one.
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=TOPK,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE, moe_z_loss_coeff=1e-3,
        hidden_dropout=0.0, attention_dropout=0.0, **recompute,
    )
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(),
        GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False), 32, 8),
    )
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    clear_aux_losses_tracker()
    model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).mean().backward()
    routers = [layer.mlp.router for layer in model.module.decoder.layers]
    counts = [router.local_tokens_per_expert.clone() for router in routers]
    z_loss = get_moe_layer_wise_logging_tracker()["z_loss"].clone()
    finalize_model_grads([model])
    return model, routers, counts, z_loss


def test_expert_bias_update_and_recompute_counts_once(single_rank_groups):
    model, routers, counts, z_loss = _step()
    for router, count in zip(routers, counts):
        assert count.sum() == TOKENS * TOPK  # every token counted once per chosen expert
        expected = RATE * torch.sign(count.mean() - count)
        torch.testing.assert_close(router.expert_bias, expected)
        assert torch.count_nonzero(router.local_tokens_per_expert) == 0
    state = model.state_dict()
    torch.testing.assert_close(state["decoder.layers.1.mlp.router.expert_bias"], routers[1].expert_bias)

    _, _, recomputed_counts, recomputed_z_loss = _step(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    for count, recomputed in zip(counts, recomputed_counts):
        torch.testing.assert_close(recomputed, count)
    torch.testing.assert_close(recomputed_z_loss, z_loss)
