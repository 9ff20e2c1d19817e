"""Several optimizer steps under pipeline parallelism against one process training the whole model.

Layouts: PP=2 (1F1B, tied embeddings), interleaved PP=2 with 2 virtual stages (G = 2), the same with an
explicit layer layout whose first chunk holds no transformer layer, PP=4 (tied),
uneven PP=2 x DP=2 (1 layer on the first stage, 3 on the last; a Llama-like model with untied
embeddings), and on 8 ranks TP=2 (+SP) x PP=2 x DP=2 and TP=2 x PP=2 x CP=2 (the Llama-like model, ring
attention); FSDP2 (TorchFullyShardedDataParallel, --use-torch-fsdp2) in place of DDP at FSDP=2 x PP=2 and
FSDP=2 x TP=2 (+SP), and likewise Megatron-FSDP's optim_grads (ShardedGradDataParallel: gradients
reduce-scattered into shards in every backward, the distributed optimizer; buckets of ~half a layer), whose
TP sums of norm gradients and PP sum of the tied embedding's run on the gradient shards, and its
optim_grads_params (ShardedParamDataParallel: the params sharded too, each bucket gathered around its layers'
forward and backward, several microbatches in flight under 1F1B and the interleaved schedule). Every layout trains
the same 4-layer model on the same global batch of 8 sequences with
Megatron-Core's path (GPTModel stages, DDP, the schedule of `get_forward_backward_func`,
finalize_model_grads, get_megatron_optimizer with Adam and clipping, the GPT task's CP batch split and
loss function); the reference is that model in one process with `torch.optim.AdamW` and `clip_grad_norm_`.

Each stage starts from the reference's weights (its layers picked by their global index: offset +
local index, reference 9.3) - except the last stage's copy of a tied embedding, which must come out of
the initialisation itself (zeroed, then all-reduced over the embedding group): it is compared with the
reference's embedding. Every step the loss (last stage), each stage's gradients (the tied copy's
gradient must be the sum of both stages', i.e. the reference's embedding gradient) and the global
gradient norm must match, and after the last step the weights (both tied copies still equal).

Tolerances in fp32, as in the tensor-parallel test: losses, gradients, grad norms 2e-5; weights after Adam
1e-4.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp.sharded_grads import ShardedGradDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.pipeline_layer_split import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tasks import gpt as gpt_task
from tests.unit_tests.reference_training import adamw_reference_steps
from tests.unit_tests.tensor_parallel.test_tensor_parallel_training import MODELS as TP_MODELS
from tests.unit_tests.tensor_parallel.test_tensor_parallel_training import (
    _COLUMNS_SPLIT,
    _ROWS_SPLIT,
    _scaled_error,
    _unsharded,
)

SEQ, MICRO_BATCH, GLOBAL_BATCH, VOCAB, STEPS = 16, 2, 8, 128, 3
LR, WEIGHT_DECAY, CLIP = 3e-3, 0.01, 0.5
TOLERANCE, WEIGHT_TOLERANCE = 2e-5, 1e-4
POSITIONS = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)

# The tensor-parallel test's GPT-2-like and Llama-like models, with 4 layers.
MODELS = {
    name: dict(config={**spec["config"], "num_layers": 4}, model=spec["model"]) for name, spec in TP_MODELS.items()
}

# (model, world size, parallel layout)
LAYOUTS = {
    "PP=2": ("gpt2", 2, dict(pp=2)),
    "PP=2, 2 virtual stages": ("gpt2", 2, dict(pp=2, vpp=2, group=2)),
    # An explicit layout whose first chunk holds only the embedding: rank 0 [E] [t], rank 1 [t t] [t L].
    "PP=2, layout E|tt|t|tL": ("gpt2", 2, dict(pp=2, vpp=2, layout="E|tt|t|tL")),
    "PP=4": ("gpt2", 4, dict(pp=4)),
    "uneven PP=2 (1+3) x DP=2": ("llama", 4, dict(pp=2, first=1, last=3)),
    "TP=2+SP x PP=2 x DP=2": ("gpt2", 8, dict(tp=2, pp=2, sequence_parallel=True)),
    "TP=2 x PP=2 x CP=2": ("llama", 8, dict(tp=2, pp=2, cp=2)),
    # FSDP2 in place of DDP (fp32 shards over the DP ranks): across pipeline stages (tied embedding), and
    # across TP ranks (an untied output layer as a unit of its own). Then sharded gradients on DDP's buffers.
    "FSDP=2 x PP=2": ("gpt2", 4, dict(pp=2, sharding="torch_fsdp2")),
    "FSDP=2 x TP=2+SP": ("llama", 4, dict(tp=2, pp=1, sequence_parallel=True, sharding="torch_fsdp2")),
    "optim_grads DP=2 x PP=2": ("gpt2", 4, dict(pp=2, sharding="optim_grads")),
    "optim_grads DP=2 x TP=2+SP": ("llama", 4, dict(tp=2, pp=1, sequence_parallel=True, sharding="optim_grads")),
    "optim_grads_params DP=2 x PP=2": ("gpt2", 4, dict(pp=2, sharding="optim_grads_params")),
    "optim_grads_params DP=2 x TP=2+SP": ("llama", 4, dict(tp=2, pp=1, sequence_parallel=True,
                                                           sharding="optim_grads_params")),
    "optim_grads_params DP=2 x PP=2, 2 virtual stages": ("gpt2", 4, dict(pp=2, vpp=2, group=2,
                                                                         sharding="optim_grads_params")),
}
ZERO2_BUCKET_SIZE = 20000  # elements: about half a layer (a GPT-2-like layer holds ~50k), several buckets a stage


def _global_batches():
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(STEPS):
        sequences = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        batches.append((sequences[:, :-1], sequences[:, 1:]))
    return batches


def _reference_loss(model, batch) -> torch.Tensor:
    tokens, labels = batch
    return model(tokens, POSITIONS[:1].expand(GLOBAL_BATCH, SEQ), None, labels=labels).mean()


def _reference_run(name: str) -> list[dict]:
    torch.manual_seed(11)
    config = TransformerConfig(**MODELS[name]["config"], use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, **MODELS[name]["model"])
    return adamw_reference_steps(model, _global_batches(), _reference_loss, LR, WEIGHT_DECAY, CLIP)


def _shard(name: str, full: torch.Tensor, rank: int, size: int, glu: bool) -> torch.Tensor:
    """This TP rank's slice of a full tensor (the inverse of `_unsharded`)."""
    if name.endswith(_ROWS_SPLIT):
        if glu and "linear_fc1" in name:
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
        return full.chunk(size, dim=0)[rank]
    if name.endswith(_COLUMNS_SPLIT):
        return full.chunk(size, dim=1)[rank]
    return full


def _global_name(name: str, offset: int) -> str:
    """`decoder.layers.<local>.x` -> `decoder.layers.<offset + local>.x`."""
    if not name.startswith("decoder.layers."):
        return name
    local, rest = name[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{offset + int(local)}.{rest}"


def _reference_name(name: str, chunk: GPTModel) -> str:
    """The tied last-stage copy of the embedding is the reference's embedding."""
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights and not chunk.pre_process:
        return "embedding.word_embeddings.weight"
    return name


def _pipeline_run(name: str, layout: dict, reference: list[dict]) -> dict:
    """Worst errors against `reference` over the steps, on this rank's stage(s)."""
    tp, pp, vpp, cp = layout.get("tp", 1), layout["pp"], layout.get("vpp"), layout.get("cp", 1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
    )
    model_parallel_cuda_manual_seed(123)
    tp_group, tp_rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    config = TransformerConfig(
        **MODELS[name]["config"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=layout.get("first"),
        num_layers_in_last_pipeline_stage=layout.get("last"), microbatch_group_size_per_vp_stage=layout.get("group"),
        sequence_parallel=layout.get("sequence_parallel", False), pipeline_dtype=torch.float32,
        pipeline_model_parallel_layout=layout.get("layout"),
        deallocate_pipeline_outputs=True, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    glu = config.gated_linear_unit
    torch.manual_seed(11)  # the reference's seed: the first stage draws the same embedding first
    chunks, offsets = [], []
    for vp_stage in range(vpp or 1):
        chunks.append(GPTModel(
            config, get_gpt_layer_local_spec(), VOCAB, SEQ, **MODELS[name]["model"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage if vpp else None,
        ))
        offsets.append(get_transformer_layer_offset(config, vp_stage=vp_stage))
        if layout.get("layout"):  # stage v * PP + p of the string is chunk v of rank p
            stage = layout["layout"].split("|")[vp_stage * pp + parallel_state.get_pipeline_model_parallel_rank()]
            assert len(chunks[-1].decoder.layers) == stage.count("t"), (vp_stage, stage)

    def named(chunk_index, source):
        """(reference name, tensor) of a chunk's params (source "param") or their main grads ("grad")."""
        chunk = chunks[chunk_index]
        for key, param in chunk.named_parameters():
            if source == "param":
                tensor = param
            elif isinstance(model[chunk_index], ShardedGradDataParallel):
                tensor = _gathered_grad(model[chunk_index], param)
            else:
                tensor = param.main_grad if hasattr(param, "main_grad") else param.grad
            if isinstance(tensor, DTensor):  # an FSDP shard: gathered over the DP ranks
                tensor = tensor.full_tensor()
            yield _reference_name(_global_name(key, offsets[chunk_index]), chunk), key, tensor

    worst = {"tied copy at init": 0.0}
    with torch.no_grad():
        for index, chunk in enumerate(chunks):
            for reference_key, key, param in named(index, "param"):
                expected = _shard(reference_key, reference[0]["weights"][reference_key], tp_rank, tp, glu)
                if key == "output_layer.weight" and reference_key != key:
                    worst["tied copy at init"] = (param - expected).abs().max().item()
                param.copy_(expected)

    model = [_wrap(config, chunk, layout.get("sharding"), disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
        use_distributed_optimizer=layout.get("sharding") in ("optim_grads", "optim_grads_params"),
    ), model)
    OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1, lr_decay_style="constant",
        start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=1, wd_incr_style="constant",
    )

    # This DP rank's microbatches of every global batch (Megatron's sampler: blocks of MICRO_BATCH x DP).
    microbatches = [
        (tokens[start : start + MICRO_BATCH], labels[start : start + MICRO_BATCH])
        for tokens, labels in _global_batches()
        for start in range(dp_rank * MICRO_BATCH, GLOBAL_BATCH, MICRO_BATCH * dp_size)
    ]
    iterators = [iter(microbatches) for _ in model]
    is_last_stage = parallel_state.is_pipeline_last_stage()
    for step in range(1, STEPS + 1):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iterators if vpp else iterators[0],
            model=model if vpp else model[0], num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * dp_size),
            seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        expected = reference[step]
        if is_last_stage:
            loss_and_tokens = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
            dist.all_reduce(loss_and_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            worst[f"loss {step}"] = abs((loss_and_tokens[0] / loss_and_tokens[1]).item() - expected["loss"])
        else:
            assert reports == []
        worst[f"grads {step}"] = max(
            _scaled_error(_unsharded(key, grad, tp_group, tp, glu), expected["grads"][reference_key])
            for index in range(len(chunks)) for reference_key, key, grad in named(index, "grad")
        )
        _, grad_norm, _ = optimizer.step()
        worst[f"grad norm {step}"] = abs(grad_norm - expected["grad_norm"]) / expected["grad_norm"]
    for chunk in model:
        chunk.start_param_sync(force_sync=True)  # optim_grads_params: every param whole
    worst["final weights"] = max(
        _scaled_error(_unsharded(key, param.detach(), tp_group, tp, glu), reference[-1]["weights"][reference_key])
        for index in range(len(chunks)) for reference_key, key, param in named(index, "param")
    )
    parallel_state.destroy_model_parallel()
    return worst


def _wrap(config, chunk, sharding, disable_bucketing):
    """The chunk in DDP, FSDP2 or Megatron-FSDP's optim_grads / optim_grads_params."""
    if sharding == "torch_fsdp2":
        return TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), chunk)
    if sharding in ("optim_grads", "optim_grads_params"):
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=sharding,
                                                   bucket_size=ZERO2_BUCKET_SIZE)
        return FullyShardedDataParallel(config, ddp_config, chunk)
    return DistributedDataParallel(config, DistributedDataParallelConfig(), chunk, disable_bucketing=disable_bucketing)


def _gathered_grad(wrapped: ShardedGradDataParallel, param: torch.nn.Parameter) -> torch.Tensor:
    """A param's reduced gradient made whole: its bucket's gradient shards gathered over the DP ranks."""
    bucket = wrapped.param_to_bucket[param]
    shards = [torch.empty_like(bucket.grad_shard) for _ in range(bucket.data_parallel_world_size)]
    dist.all_gather(shards, bucket.grad_shard, group=bucket.data_parallel_group)
    start, end = bucket.param_to_index[param]
    return torch.cat(shards)[start:end].view(param.shape)


def _forward_step(data_iterator, model):
    """The GPT task's path: this CP rank's chunks of the microbatch, the task's loss function."""
    tokens, labels = next(data_iterator)
    batch = get_batch_on_this_cp_rank(
        dict(tokens=tokens, labels=labels, position_ids=POSITIONS, loss_mask=torch.ones(tokens.shape))
    )
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return losses, partial(gpt_task.loss_func, batch["loss_mask"])


def _layouts_of_world(rank, world_size, references):
    """{layout: worst errors} of every layout of this world size (called by the folder's conftest)."""
    return {
        layout: _pipeline_run(name, parallel, references[name])
        for layout, (name, size, parallel) in LAYOUTS.items()
        if size == world_size
    }


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_pipeline_training_matches_one_process(world_size, pipeline_ranks):
    """Same losses, gradients, grad norms and final weights as the whole model in one process, and the
    last stage's tied output weight equals the first stage's embedding right after initialisation."""
    for per_rank in pipeline_ranks(world_size):
        for layout, worst in per_rank["training"].items():
            worst = dict(worst)
            assert worst.pop("tied copy at init") == 0.0, layout
            weights = worst.pop("final weights")
            assert weights < WEIGHT_TOLERANCE, f"{layout}: final weights differ by {weights}"
            bad = {key: value for key, value in worst.items() if value > TOLERANCE}
            assert not bad, f"{layout}: {bad}"
