"""A tiny Llama-like GPTModel (SwiGLU, 2 key/value groups, RoPE, RMSNorm, untied output) trained under a
chosen tensor-parallel size on the ranks of the current process group, for the checkpoint tests.

The weights are drawn on the CPU from the full master tensors (`use_cpu_initialization`), so every TP size
starts from the same model; the global batch is split over the data-parallel ranks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

VOCAB_SIZE = 256  # divisible by 4: no padding question at TP 1, 2, 4
SEQUENCE_LENGTH = 16
GLOBAL_BATCH = 8


def set_layout(tensor_parallel_size: int) -> None:
    """Re-creates the parallel groups with this TP size (DP = world / TP)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


def build(tensor_parallel_size: int, distributed_optimizer: bool, seed: int):
    """(DDP-wrapped model, optimizer) under the current layout."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=tensor_parallel_size,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB_SIZE, SEQUENCE_LENGTH, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True, bucket_size=2000)
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
        [ddp],
    )
    return ddp, optimizer


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB_SIZE, (GLOBAL_BATCH, SEQUENCE_LENGTH + 1), generator=generator)
    rows = GLOBAL_BATCH // parallel_state.get_data_parallel_world_size()
    start = parallel_state.get_data_parallel_rank() * rows
    return tokens[start : start + rows]


def train_step(ddp, optimizer, step: int) -> float:
    """One optimizer step on the global batch of `step`; returns the global mean loss."""
    tokens = _batch(step)
    positions = torch.arange(SEQUENCE_LENGTH).expand(tokens.size(0), -1)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    finalize_model_grads([ddp])
    assert optimizer.step()[0]
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    return reported.item() / parallel_state.get_data_parallel_world_size()


def full_logits(ddp) -> torch.Tensor:
    """Logits [b, s, V] of a fixed batch, gathered over the TP ranks."""
    ddp.start_param_sync(force_sync=True)
    tokens = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, VOCAB_SIZE, (2, SEQUENCE_LENGTH), generator=tokens)
    positions = torch.arange(SEQUENCE_LENGTH).expand(2, -1)
    with torch.no_grad():
        logits = ddp(tokens, positions, None)
    return gather_from_tensor_model_parallel_region(logits)
