"""`finalize_model_grads`: everything that must happen to the gradients between backward and the optimizer.

1. data-parallel reduction of every chunk's grad buffers (`finish_grad_sync`: an all-reduce, or a
   reduce-scatter for the distributed optimizer; waits for those launched during backward);
2. with tensor parallelism, all-reduce over TP of the grads of params replicated across TP ranks that
   saw different tokens or heads: norm weights under sequence parallelism (`sequence_parallel=True`)
   and the q/k layernorms (`qk_layernorm`);
3. with pipeline parallelism, all-reduce over the embedding group of the tied word embedding /
   output weight (`shared_embedding=True`), which lives on both the first and the last stage, so the
   two copies take the same step (and likewise the position embeddings over their group);
4. with `num_tokens` (--calculate-per-token-loss): divide all grads by the global count of loss
   tokens, broadcast from the last pipeline stage and summed over data x context parallel ranks;
5. with aux-loss-free MoE balancing (`moe_router_enable_expert_bias`): move every router's expert bias
   by the step's token counts, summed over the tensor x data x context parallel ranks.

Steps 2 and 3 work on what each chunk holds of a param's data-parallel-reduced gradient
(`chunk.reduced_grad`): DDP's `main_grad`, an FSDP2 shard's local rows, or, with sharded gradients
(ShardedGradDataParallel), this rank's piece of its bucket's gradient shard; the copies being summed are
sharded alike, so the sum of the pieces is the piece of the sum.
"""

from typing import List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import parallel_state
from ..timers import timed
from ..transformer.moe.load_balancing import get_updated_expert_bias


def _all_reduce_coalesced(grads: List[torch.Tensor], group) -> None:
    """Sums `grads` over `group` in one collective (every rank of the group passes the same shapes)."""
    grads = [grad for grad in grads if grad.numel() > 0]
    if not grads:
        return
    coalesced = _flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        grad.copy_(synced)


def _allreduce_layernorm_grads(model: List[torch.nn.Module], config) -> None:
    """Sums over TP the grads of TP-replicated params that each TP rank fed different data."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    # Per-head q/k norms see only this rank's heads. Multi-latent attention's q/kv latent norms see the same
    # latents on every rank instead (or, under sequence parallelism, marked `sequence_parallel`).
    qk_layernorm = getattr(config, "qk_layernorm", False) and not getattr(config, "multi_latent_attention", False)

    def summed_over_tp(name: str, param: torch.nn.Parameter) -> bool:
        is_qk_layernorm = qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        return param.requires_grad and (getattr(param, "sequence_parallel", False) or is_qk_layernorm)

    grads = [
        chunk.reduced_grad(param)
        for chunk in model
        for name, param in chunk.named_parameters()
        if summed_over_tp(name, param)
    ]
    _all_reduce_coalesced(grads, parallel_state.get_tensor_model_parallel_group())


def _stage_chunk(model: List[torch.nn.Module]) -> torch.nn.Module:
    """The chunk that holds this stage's embedding (first stage) or output layer (last stage)."""
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and not parallel_state.is_pipeline_first_stage(
        ignore_virtual=True
    ):
        return model[-1]
    return model[0]


def _allreduce_stage_copies(model: List[torch.nn.Module], group, is_copy) -> None:
    """Sums over `group` the grads of this stage's params for which `is_copy(name, param)` holds."""
    if dist.get_world_size(group) == 1:
        return
    chunk = _stage_chunk(model)
    grads = [
        chunk.reduced_grad(param)
        for name, param in chunk.named_parameters()
        if param.requires_grad and is_copy(name, param)
    ]
    _all_reduce_coalesced(grads, group)


def _allreduce_embedding_grads(model: List[torch.nn.Module]) -> None:
    """Sums the grads of weights that live on several pipeline stages over their group."""
    if parallel_state.is_rank_in_embedding_group():
        _allreduce_stage_copies(
            model, parallel_state.get_embedding_group(), lambda name, param: getattr(param, "shared_embedding", False)
        )
    if parallel_state.is_rank_in_position_embedding_group():
        _allreduce_stage_copies(
            model,
            parallel_state.get_position_embedding_group(),
            lambda name, param: name.endswith("position_embeddings.weight"),
        )


def _update_router_expert_bias(model: List[torch.nn.Module]) -> None:
    """bias += rate * sign(mean load - load) for every router with an expert bias, then zero the counts."""
    routers = [
        module for chunk in model for module in chunk.modules() if getattr(module, "expert_bias", None) is not None
    ]
    if not routers:
        return
    tokens_per_expert = torch.stack([router.local_tokens_per_expert for router in routers])  # [L, E]
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(tokens_per_expert, group=group)
    expert_bias = torch.stack([router.expert_bias for router in routers])
    updated = get_updated_expert_bias(tokens_per_expert, expert_bias, routers[0].config.moe_router_bias_update_rate)
    for router, bias in zip(routers, updated):
        router.expert_bias.copy_(bias)
        router.local_tokens_per_expert.zero_()


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None) -> None:
    """Finishes the gradients of `model` (DDP-wrapped chunks, one per virtual stage) for the optimizer.

    `num_tokens`: this rank's count of loss tokens in the global batch (meaningful on the last pipeline
    stage; an int tensor on every stage); when given, all grads are divided by the global count.
    """
    config = getattr(model[0], "config", None)
    timers = getattr(config, "timers", None)
    barrier = getattr(config, "barrier_with_L1_time", False)
    with timed(timers, "all-grads-sync", barrier=barrier):
        for chunk in model:
            chunk.finish_grad_sync()
    with timed(timers, "layernorm-grads-all-reduce", barrier=barrier):
        _allreduce_layernorm_grads(model, config)
    with timed(timers, "embedding-grads-all-reduce", barrier=barrier):
        _allreduce_embedding_grads(model)
    if getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias(model)

    if num_tokens is not None:
        dist.broadcast(
            num_tokens,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        # On the device (no host read): a step without loss tokens keeps its gradients as they are.
        scaling = 1.0 / num_tokens.clamp(min=1)
        for chunk in model:
            chunk.scale_gradients(scaling)
