"""A tiny GPTModel (4 layers, SwiGLU, 2 key/value groups, RoPE, RMSNorm, tied embeddings; optionally MoE)
trained under a chosen TP x PP (x EP) layout on the ranks of the current process group, with Megatron-Core's
path (GPTModel stages, DDP, the schedule of `get_forward_backward_func`, finalize_model_grads,
get_megatron_optimizer), for the checkpoint tests. Fixed global batches of 8 sequences, split over the
data-parallel ranks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

VOCAB_SIZE = 256  # divisible by 4: the same padding at TP 1, 2, 4
SEQUENCE_LENGTH, MICRO_BATCH, GLOBAL_BATCH = 16, 2, 8
POSITIONS = torch.arange(SEQUENCE_LENGTH).expand(MICRO_BATCH, SEQUENCE_LENGTH)


def build(tensor_parallel: int, pipeline_parallel: int, distributed_optimizer: bool, seed: int,
          expert_parallel: int = 0, expert_tensor_parallel: int | None = None):
    """(DDP-wrapped stage of the model, optimizer) under a fresh TP x PP (x DP) layout. With
    `expert_parallel` (EP >= 1) every layer's MLP is a MoE layer of 4 experts split over EP ranks (and
    over `expert_tensor_parallel` ranks each, default TP)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel,
                                             expert_model_parallel_size=expert_parallel or 1,
                                             expert_tensor_parallel_size=expert_tensor_parallel)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=24, expert_model_parallel_size=expert_parallel,
               expert_tensor_parallel_size=expert_tensor_parallel, moe_router_topk=2) if expert_parallel else {}
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=torch.float32, **moe,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False) if moe else get_gpt_layer_local_spec()
    model = GPTModel(config, spec, VOCAB_SIZE, SEQUENCE_LENGTH, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
        [ddp],
    )
    return ddp, optimizer


def _from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's `tensor` on every stage (same shape everywhere)."""
    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def _run(ddp, microbatches, forward_only: bool, loss_func):
    iterator = iter(microbatches)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        return model(tokens, POSITIONS, None, labels=labels), loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterator, model=ddp, num_microbatches=len(microbatches),
        seq_length=SEQUENCE_LENGTH, micro_batch_size=MICRO_BATCH, forward_only=forward_only,
    )


def train_step(ddp, optimizer, step: int) -> float:
    """One optimizer step on the global batch of `step`; returns the global token-mean loss on every rank."""
    tokens = torch.randint(0, VOCAB_SIZE, (GLOBAL_BATCH, SEQUENCE_LENGTH + 1),
                           generator=torch.Generator().manual_seed(step))
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    microbatches = [(tokens[start : start + MICRO_BATCH, :-1], tokens[start : start + MICRO_BATCH, 1:])
                    for start in range(rank * MICRO_BATCH, GLOBAL_BATCH, MICRO_BATCH * size)]

    def loss_func(losses):
        loss_sum, num_tokens = losses.float().sum(), torch.tensor(losses.numel(), dtype=torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reports = _run(ddp, microbatches, False, loss_func)
    assert optimizer.step()[0]
    total = torch.zeros(2)
    if parallel_state.is_pipeline_last_stage():
        total = torch.stack([report["lm loss"] for report in reports]).sum(dim=0)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    total = _from_last_stage(total)
    return (total[0] / total[1]).item()


def full_logits(ddp) -> torch.Tensor:
    """Logits [b, s, V] of a fixed batch, gathered over the TP ranks, on every rank."""
    ddp.start_param_sync(force_sync=True)
    tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(99))
    gathered = []

    def keep_logits(logits):
        gathered.append(gather_from_tensor_model_parallel_region(logits))
        return logits.sum(), torch.tensor(1, dtype=torch.int), {}

    with torch.no_grad():
        _run(ddp, [(tokens, None)], True, keep_logits)
    logits = gathered[0] if gathered else torch.zeros(MICRO_BATCH, SEQUENCE_LENGTH, VOCAB_SIZE)
    return _from_last_stage(logits.contiguous())
