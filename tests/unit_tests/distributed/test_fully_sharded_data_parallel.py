"""Fully sharded data parallelism on gloo ranks against one process: FSDP2 (TorchFullyShardedDataParallel) and
each of Megatron-FSDP's sharding strategies (and ZeRO-3 with --calculate-per-token-loss's summed gradients, and
with MoE layers: the experts' own optimizer) train a tiny GPT like plain torch AdamW on the whole batch.

Each rank runs its half of every global batch; the reference (run on every rank, alone) runs all of it. fp32
throughout: the losses, gradient norms and final weights agree to float rounding of the differently ordered
sums (the mean gradient is reduced over the ranks, the norm summed over shards). FSDP with TP and PP is
tested in the 4-rank pipeline harness (pipeline_parallel/test_pipeline_training.py)."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpointing.distrib_optim import finish_param_gathers
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.reference_training import adamw_reference_steps

SEQ, MICRO_BATCH, VOCAB, STEPS = 8, 2, 61, 3
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 0.05  # a clip small enough to act at every step


def _gpt(per_token_loss: bool = False, experts: int | None = None, recompute: bool = False) -> GPTModel:
    """Tied: the root unit holds the embedding, gathered once for the input and the output layer. With
    `experts`, MoE layers (top-1, no auxiliary loss, whose batch statistics a data-parallel split changes); with
    `recompute`, full recompute of each layer (the same values)."""
    torch.manual_seed(11)
    recompute_flags = dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1) if recompute else {}
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               calculate_per_token_loss=per_token_loss, num_moe_experts=experts,
                               moe_router_topk=1, **recompute_flags)
    spec = get_gpt_layer_local_spec(num_experts=experts)
    return GPTModel(config, spec, VOCAB, SEQ, share_embeddings_and_output_weights=True)


def _global_batches(data_parallel_size: int) -> list:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (MICRO_BATCH * data_parallel_size, SEQ + 1), generator=generator)
            for _ in range(STEPS)]


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()


def _reference(data_parallel_size: int, experts: int | None = None) -> list:
    steps = adamw_reference_steps(_gpt(experts=experts), _global_batches(data_parallel_size), _loss, LR, WEIGHT_DECAY,
                                  CLIP)
    return [(step["loss"], step["grad_norm"]) for step in steps[1:]], steps[-1]["weights"]


def _train(wrapped, optimizer_config: OptimizerConfig, data_parallel_rank: int, data_parallel_size: int):
    """(loss, grad norm) per step and the final full weights of `wrapped` trained on this rank's half."""
    optimizer = get_megatron_optimizer(optimizer_config, [wrapped])
    for param_group in optimizer.param_groups:  # the scheduler's job in a training run
        param_group["weight_decay"] = WEIGHT_DECAY * param_group["wd_mult"]
    group = parallel_state.get_data_parallel_group()
    history = []
    for batch in _global_batches(data_parallel_size):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _loss(wrapped, batch.chunk(data_parallel_size)[data_parallel_rank])
        if wrapped.config.calculate_per_token_loss:
            # Summed over tokens and ranks, then divided by the global token count.
            (loss * loss.new_tensor(MICRO_BATCH * SEQ)).backward()
            finalize_model_grads([wrapped], num_tokens=torch.tensor(MICRO_BATCH * SEQ))
        else:
            loss.backward()
            finalize_model_grads([wrapped])
        updated, grad_norm, _ = optimizer.step()
        assert updated
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=group)
        history.append((mean_loss.item() / data_parallel_size, grad_norm))
    for chunk in (wrapped,):
        chunk.start_param_sync(force_sync=True)
    weights = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
               for name, value in wrapped.module.state_dict().items() if torch.is_tensor(value)}
    return history, weights, type(optimizer).__name__


def _strategies(rank, world_size):
    parallel_state.initialize_model_parallel()
    references = {None: _reference(world_size), 2: _reference(world_size, experts=2)}
    results = {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params", "optim_grads_params per token",
                     "optim_grads_params MoE"):
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True,
                                                   data_parallel_sharding_strategy=strategy.split()[0])
        experts = 2 if strategy.endswith("MoE") else None
        model = _gpt(per_token_loss=strategy.endswith("per token"), experts=experts)
        wrapped = FullyShardedDataParallel(model.config, ddp_config, model)
        optimizer_config = OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                                           use_distributed_optimizer=strategy != "no_shard")
        results[strategy] = (*_train(wrapped, optimizer_config, rank, world_size), *references[experts])
    return results


def test_each_sharding_strategy_trains_like_one_process():
    for results in run_distributed(_strategies, 2):
        for strategy, (history, weights, optimizer, reference_history, reference_weights) in results.items():
            assert optimizer == ("ChainedOptimizer" if strategy.endswith("MoE") else "FP32Optimizer"
                                 if strategy == "no_shard" else "DistributedOptimizer")
            for step, ((loss, norm), (expected_loss, expected_norm)) in enumerate(zip(history, reference_history)):
                assert loss == pytest.approx(expected_loss, rel=1e-5), f"{strategy}: loss at step {step}"
                assert norm == pytest.approx(expected_norm, rel=1e-5), f"{strategy}: grad norm at step {step}"
            assert weights.keys() == reference_weights.keys()
            for name, value in weights.items():
                torch.testing.assert_close(value, reference_weights[name], rtol=1e-5, atol=1e-5, msg=lambda message: f"{strategy} {name}: {message}")



def _rope_loss_and_grads(recompute: bool):
    """One bf16 step of a RoPE model under FSDP2 (--use-torch-fsdp2, one rank): its loss, full gradients and the dtypes of the
    rotary angles as each layer's forward received them (recomputed forwards included)."""
    torch.manual_seed(3)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bf16=True,
                               params_dtype=torch.bfloat16,
                               recompute_granularity="full" if recompute else None,
                               recompute_method="uniform" if recompute else None,
                               recompute_num_layers=1 if recompute else None)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")
    wrapped = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
    angle_dtypes = []
    for layer in model.decoder.layers:  # after FSDP's own pre-forward hook
        layer.register_forward_pre_hook(
            lambda module, args, kwargs: angle_dtypes.append(kwargs["rotary_pos_emb"].dtype), with_kwargs=True)
    loss = _loss(wrapped, _global_batches(1)[0])
    loss.backward()
    grads = {name: param.grad.full_tensor() for name, param in wrapped.module.named_parameters()}
    return loss.item(), grads, angle_dtypes


def test_full_recompute_of_rope_layers_recomputes_the_forward_exactly(single_rank_groups):
    """The rotary angles enter each layer unit in fp32, as in a DDP run, also when full recompute runs the
    layer again in backward. FSDP2 casts a unit's inputs to the compute dtype in forward (MixedPrecisionPolicy's
    cast_forward_inputs) but, in torch 2.11, not in the recomputed forward: the GPU run then stopped with
    torch.utils.checkpoint's 'different metadata' error; and bf16 angles are off by radians at long positions."""
    loss, grads, angle_dtypes = _rope_loss_and_grads(recompute=False)
    recomputed_loss, recomputed_grads, recomputed_angle_dtypes = _rope_loss_and_grads(recompute=True)
    assert angle_dtypes == [torch.float32] * 2
    assert recomputed_angle_dtypes == [torch.float32] * 4  # forward, then the recompute in backward
    assert recomputed_loss == loss
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def _nan_in_emptied_gradients(wrapped) -> None:
    """Gradient storage is emptied, not zeroed (distributed_data_parallel.py): make its old bytes NaN whenever
    it is emptied (each step; each materialisation of a transient bucket), so that reading them would show."""
    def fill(params):
        for param in params:
            param.main_grad.fill_(float("nan"))

    zero_grad_buffer = wrapped.zero_grad_buffer

    def emptied_with_nan():
        zero_grad_buffer()
        fill(param for buffer in wrapped.buffers if buffer.grad_data is not None for param in buffer.params)

    wrapped.zero_grad_buffer = emptied_with_nan
    for bucket in (bucket for buffer in wrapped.buffers for bucket in buffer.buckets):
        if hasattr(bucket, "materialize"):
            def materialize(bucket=bucket, original=bucket.materialize):
                fresh = not bucket.materialized
                original()
                if fresh:
                    fill(bucket.params_list)

            bucket.materialize = materialize


def _microbatched_steps(strategy: str, fusion: bool, rank: int, world_size: int):
    """Two steps of two microbatches each (this rank's halves) with buckets of ~1 layer, NaN in the emptied
    gradient storage: (losses, grad norms, final weights, the wrapper's buffers)."""
    torch.manual_seed(11)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               gradient_accumulation_fusion=fusion, bf16=fusion,
                               params_dtype=torch.bfloat16 if fusion else torch.float32)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                               overlap_grad_reduce=True, bucket_size=4000,
                                               grad_reduce_in_fp32=True)
    wrapped = FullyShardedDataParallel(config, ddp_config, model)
    _nan_in_emptied_gradients(wrapped)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP, use_distributed_optimizer=True,
                                                       bf16=fusion), [wrapped])
    buckets = [bucket for buffer in wrapped.buffers for bucket in buffer.buckets]
    launches = []  # reductions launched per bucket, one entry per backward

    def counted(bucket, start=None):
        def start_grad_sync(async_op):
            launches[-1][buckets.index(bucket)] += 1
            start(async_op)
        return start_grad_sync

    for bucket in buckets:
        bucket.start_grad_sync = counted(bucket, bucket.start_grad_sync)
    history, transient_bytes = [], []
    for batch in _global_batches(world_size)[:2]:
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        microbatches = batch.chunk(world_size)[rank].chunk(2)
        for index, microbatch in enumerate(microbatches):
            launches.append([0] * len(buckets))
            with wrapped.no_sync() if index == 0 else contextlib.nullcontext():
                (_loss(wrapped, microbatch) / 2).backward()
            transient_bytes.append(sum(bucket.grad_data.untyped_storage().nbytes()
                                       for buffer in wrapped.buffers for bucket in buffer.buckets))
        finalize_model_grads([wrapped])
        _, grad_norm, _ = optimizer.step()
        history.append(grad_norm)
    wrapped.start_param_sync(force_sync=True)
    weights = {name: param.detach().float().clone() for name, param in model.named_parameters()}
    return history, weights, wrapped.buffers, (transient_bytes, launches)


def _zero2_against_distributed_optimizer(rank, world_size):
    parallel_state.initialize_model_parallel()
    results = {}
    for fusion in (False, True):
        norms, weights, buffers, _ = _microbatched_steps("optim", fusion, rank, world_size)
        sharded_norms, sharded_weights, sharded_buffers, transient = _microbatched_steps("optim_grads", fusion, rank,
                                                                                        world_size)
        layout = [(buffer.numel, [bucket.grad_data.numel() for bucket in buffer.buckets]) for buffer in buffers]
        sharded_layout = [(buffer.numel, [bucket.grad_data.numel() for bucket in buffer.buckets])
                          for buffer in sharded_buffers]
        layer_buckets = {}  # transformer layer: the buckets holding its params (optim_grads)
        for buffer in sharded_buffers:
            for param, bucket in buffer.param_to_bucket.items():
                name = buffer.param_to_name[param]
                if name.startswith("decoder.layers."):
                    layer_buckets.setdefault(name.split(".")[2], set()).add(bucket.bucket_id)
        persistent = {"grad buffer": [buffer.grad_data for buffer in sharded_buffers],
                      "grad shards": [bucket.grad_shard.numel() for buffer in sharded_buffers
                                      for bucket in buffer.buckets],
                      "param buffer": [buffer.param_data.numel() for buffer in sharded_buffers]}
        zero3_norms, zero3_weights, _, zero3_transient = _microbatched_steps("optim_grads_params", fusion, rank,
                                                                             world_size)
        results[fusion] = (norms, weights, sharded_norms, sharded_weights, layout, sharded_layout, layer_buckets,
                           persistent, transient, (zero3_norms, zero3_weights, zero3_transient))
    return results


def test_optim_grads_shards_gradients_and_accumulates_microbatches_like_the_distributed_optimizer():
    """ZeRO-2 (optim_grads), and ZeRO-3 (optim_grads_params) with it, reduce-scatters every microbatch's gradients into fp32 shards; the distributed
    optimizer (optim) sums them whole and reduce-scatters once, its buckets cut by size alone where optim_grads'
    hold whole layers. Same steps: grad norms and fp32 weights agree to rounding; in bf16 with gradient-accumulation fusion (the GEMMs write the transient
    main_grad) the weights to within a bf16 step. No gradient storage outlives a backward, each bucket is
    reduce-scattered once per backward; each rank keeps 1/dp of every bucket's gradient and the whole param
    buffer."""
    for results in run_distributed(_zero2_against_distributed_optimizer, 2):
        for fusion, (norms, weights, sharded_norms, sharded_weights, layout, sharded_layout, layer_buckets,
                     persistent, transient, (zero3_norms, zero3_weights, zero3_transient)) in results.items():
            tolerance = 1e-4 if fusion else 1e-6  # measured: 3.1e-5 (bf16 weights), 4.8e-7 (fp32)
            assert len(layout[0][1]) > len(sharded_layout[0][1]) > 2, "several buckets, layers cut by optim only"
            assert sorted(layer_buckets) == ["0", "1"] and all(len(ids) == 1 for ids in layer_buckets.values())
            assert persistent["grad buffer"] == [None]
            assert persistent["grad shards"] == [numel // 2 for numel in sharded_layout[0][1]]
            assert persistent["param buffer"] == [sharded_layout[0][0]]
            for transient_bytes, launches in (transient, zero3_transient):
                assert transient_bytes == [0] * 4
                assert len(launches) == 4 and all(counts == [1] * len(counts) for counts in launches), launches
            assert sharded_norms == pytest.approx(norms, rel=1e-5)
            assert zero3_norms == pytest.approx(norms, rel=1e-5)
            for name, value in weights.items():
                for sharded in (sharded_weights, zero3_weights):
                    torch.testing.assert_close(sharded[name], value, rtol=tolerance, atol=tolerance,
                                               msg=lambda message: f"bf16 {fusion} {name}: {message}")


def _zero3_steps(recompute: bool, rank: int, world_size: int):
    """ZeRO-3 (fp32, buckets of ~1 layer) on this rank's half of each global batch in two microbatches: (loss,
    grad norm) per step, the final weights, and the bytes of each layer's bucket storage seen at each layer's
    forward pre-hook, in forward and in the recomputed forward (backward): (layer, in backward, [layer 0, layer 1])."""
    model = _gpt(recompute=recompute)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                               bucket_size=4000)
    wrapped = FullyShardedDataParallel(model.config, ddp_config, model)
    layers = list(model.decoder.layers)
    layer_buckets = [wrapped.param_to_bucket[next(layer.parameters())] for layer in layers]
    storage = []

    def record(module, unused):
        storage.append((layers.index(module), torch._C._current_graph_task_id() != -1,
                        [bucket.param_data.untyped_storage().nbytes() for bucket in layer_buckets]))

    for layer in layers:  # after the wrapper's own pre-hook
        layer.register_forward_pre_hook(record)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                                                       use_distributed_optimizer=True), [wrapped])
    for param_group in optimizer.param_groups:
        param_group["weight_decay"] = WEIGHT_DECAY * param_group["wd_mult"]
    history, between = [], []
    for batch in _global_batches(world_size):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        losses = []
        for microbatch in batch.chunk(world_size)[rank].chunk(2):
            loss = _loss(wrapped, microbatch) / 2
            between.append(("after forward", [bucket.param_data.untyped_storage().nbytes() for bucket in layer_buckets]))
            loss.backward()
            between.append(("after backward", [bucket.params_gathered for buffer in wrapped.buffers
                                               for bucket in buffer.buckets]))
            losses.append(loss.detach())
        finalize_model_grads([wrapped])
        _, grad_norm, _ = optimizer.step()
        mean_loss = sum(losses)
        dist.all_reduce(mean_loss, group=parallel_state.get_data_parallel_group())
        history.append((mean_loss.item() / world_size, grad_norm))
    finish_param_gathers([wrapped])  # what a checkpoint save does first: nothing to gather here
    between.append(("before a save",
                    [bucket.params_gathered for buffer in wrapped.buffers for bucket in buffer.buckets]))
    wrapped.start_param_sync(force_sync=True)
    weights = {name: value.detach().clone() for name, value in model.state_dict().items() if torch.is_tensor(value)}
    return history, weights, storage[:6 if recompute else 2], between[:2] + between[-1:]


def _zero3(rank, world_size):
    parallel_state.initialize_model_parallel()
    return {recompute: _zero3_steps(recompute, rank, world_size) for recompute in (False, True)}, _reference(world_size)


def test_zero3_with_microbatches_and_full_recompute_trains_like_one_process():
    """optim_grads_params at DP=2, two microbatches per step (params gathered again for each), also under full
    recompute (the recomputed forward finds its params gathered, the next layer's prefetched): losses, grad norms
    and final weights of one process on the whole batch, fp32, to rel 1e-5 (rounding of the reduced sums). A
    layer's param storage exists only around its forward and backward: at layer 1's forward layer 0's is released;
    the last layer's stays from its forward to its backward; at layer 0's recomputed forward layer 1's is released
    (its reduce-scatter launched); nothing is gathered after a backward, nor by a checkpoint save's param sync."""
    for results, (reference_history, reference_weights) in run_distributed(_zero3, 2):
        for recompute, (history, weights, storage, between) in results.items():
            for step, ((loss, norm), (expected_loss, expected_norm)) in enumerate(zip(history, reference_history)):
                assert loss == pytest.approx(expected_loss, rel=1e-5), f"recompute {recompute}: loss at step {step}"
                assert norm == pytest.approx(expected_norm, rel=1e-5), f"recompute {recompute}: norm at step {step}"
            for name, value in weights.items():
                torch.testing.assert_close(value, reference_weights[name], rtol=1e-5, atol=1e-5)
            full = max(storage[0][2])
            assert full > 0
            assert storage[1] == (1, False, [0, full])
            if recompute:  # layer 0, 1 forward; layer 1, 0 recomputed in backward, for each of two microbatches
                assert [(layer, backward) for layer, backward, _ in storage[:4]] == [(0, False), (1, False),
                                                                                     (1, True), (0, True)]
                assert storage[3][2] == [full, 0]
            assert between[0] == ("after forward", [0, full])
            assert between[1][0] == "after backward" and not any(between[1][1])
            assert between[2][0] == "before a save" and not any(between[2][1])
