"""Megatron-Core's minimal training loop (Megatron-LM's `examples/run_simple_mcore_train_loop.py`).

    torchrun --nproc_per_node=2 examples/run_simple_mcore_train_loop.py [--checkpoint-dir ckpt]
    python examples/run_simple_mcore_train_loop.py [--checkpoint-dir ckpt]

(after `pip install -e .`, or with the repository root on PYTHONPATH). Under torchrun the 2-layer
GPTModel is split over 2 tensor-parallel ranks (more ranks add data parallelism); as one plain process it
runs at TP=1. It trains for a few iterations on MockGPTDataset with the no-pipelining schedule,
Megatron-Core's DDP and optimizer, then saves a checkpoint, loads it into a freshly initialised model and
checks that the two models are equal. GPUs use NCCL; a machine without CUDA runs on the CPU with gloo.

Checkpoint format: Megatron's example saves with `dist_checkpointing` (sharded, loadable at another TP
size); this one uses plain torch.save instead: each tensor-parallel rank saves its own shard of the state
dict, `<checkpoint-dir>/tp_rank_00.pt`, `tp_rank_01.pt`, ..., written to a temporary file and renamed so
that a crash never leaves a truncated file.
"""

import argparse
import os
from functools import partial
from typing import Callable, Dict, Iterator, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
# Megatron-LM takes the null tokenizer from megatron.core.tokenizers; here the tokenizers live in the
# training layer (they import no torch, so that preprocessing runs without it).
from megatron.core.tokenizers import NullTokenizer

SEQUENCE_LENGTH = 64
VOCAB_SIZE = 128
MICRO_BATCH_SIZE = 4
NUM_MICROBATCHES = 2
NUM_ITERATIONS = 5


def print_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def initialize_distributed(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1):
    """torch.distributed from torchrun's environment (or a one-process group), then Megatron-Core's
    parallel groups. Returns the device this rank computes on."""
    parallel_state.destroy_model_parallel()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend, device = "nccl", torch.device("cuda", torch.cuda.current_device())
    else:
        backend, device = "gloo", torch.device("cpu")
    # NCCL binds each rank's communicator to its GPU up front when told which one it is.
    device_id = device if device.type == "cuda" else None
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device_id)  # env:// rendezvous from torchrun
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
    return device


def model_provider() -> GPTModel:
    """A 2-layer GPT. The full weights are drawn on the CPU and then split, so the model is the same at
    any TP size; without dropout a TP=2 run computes the same losses as one process."""
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQUENCE_LENGTH,
    )


def get_train_data_iterator() -> Iterator:
    """Micro-batches of MockGPTDataset: the ranks of one tensor-parallel group read the same samples,
    each data-parallel replica its own share."""
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=SEQUENCE_LENGTH,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # plain causal attention needs no mask tensor
        tokenizer=NullTokenizer(vocab_size=VOCAB_SIZE),
    )
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    num_samples = NUM_ITERATIONS * NUM_MICROBATCHES * MICRO_BATCH_SIZE * data_parallel_size
    builder = BlendedMegatronDatasetBuilder(MockGPTDataset, [num_samples, None, None], lambda: True, config)
    train_dataset, _, _ = builder.build()
    # The dataset already shuffles its samples (with random_seed); the sampler only shards them.
    sampler = DistributedSampler(
        train_dataset, num_replicas=data_parallel_size, rank=parallel_state.get_data_parallel_rank(), shuffle=False
    )
    return iter(DataLoader(train_dataset, batch_size=MICRO_BATCH_SIZE, sampler=sampler))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict]:
    """Megatron-Core's loss contract: (sum of the token losses, number of tokens, report); the schedule
    divides the sum by the token count and the number of micro-batches."""
    losses = output_tensor.float().view(-1)  # [b * s] per-token cross entropy
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": (loss_sum / num_tokens).detach()}


def forward_step_func(data_iterator: Iterator, model: torch.nn.Module) -> Tuple[torch.Tensor, Callable]:
    """One micro-batch forward: the model returns per-token losses [b, s] when given labels."""
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in next(data_iterator).items()}
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def _shard_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, f"tp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}.pt")


def save_checkpoint(checkpoint_dir: str, model: torch.nn.Module) -> None:
    """Each tensor-parallel rank of the first data-parallel replica writes its shard (temp, then rename)."""
    if parallel_state.get_data_parallel_rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save(model.state_dict(), _shard_path(checkpoint_dir) + ".tmp")
        os.replace(_shard_path(checkpoint_dir) + ".tmp", _shard_path(checkpoint_dir))
    dist.barrier()


def load_checkpoint(checkpoint_dir: str, model: torch.nn.Module) -> torch.nn.Module:
    """Loads this rank's tensor-parallel shard into `model`."""
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(_shard_path(checkpoint_dir), map_location=device, weights_only=True))
    return model


def differing_tensors(a: torch.nn.Module, b: torch.nn.Module) -> list:
    """Names of the state-dict tensors that are not identical in `a` and `b` (or not in both)."""
    state_a, state_b = a.state_dict(), b.state_dict()
    missing = sorted(state_a.keys() ^ state_b.keys())
    return missing + [name for name in state_a.keys() & state_b.keys() if not torch.equal(state_a[name], state_b[name])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", default="ckpt", help="Where each TP rank saves its shard.")
    checkpoint_dir = parser.parse_args().checkpoint_dir

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tensor_model_parallel_size = 2 if world_size > 1 else 1
    device = initialize_distributed(tensor_model_parallel_size, pipeline_model_parallel_size=1)
    if world_size == 1:
        print_rank_0("note: one process, so TP=1; run under `torchrun --nproc_per_node=2` for TP=2")
    torch.manual_seed(123)  # the CPU generator draws the initial weights (use_cpu_initialization)
    model_parallel_cuda_manual_seed(123)

    gpt_model = model_provider().to(device)
    model = DistributedDataParallel(gpt_model.config, DistributedDataParallelConfig(), gpt_model)
    # Megatron's optimizer steps on DDP's `main_grad` buffers (a plain torch.optim.Adam would see no
    # `.grad`: DDP moves every gradient into its buffer).
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=5e-3, weight_decay=0.01), [model])
    train_iterator = get_train_data_iterator()
    forward_backward_func = get_forward_backward_func()

    for iteration in range(1, NUM_ITERATIONS + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=train_iterator,
            model=model,
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQUENCE_LENGTH,
            micro_batch_size=MICRO_BATCH_SIZE,
            decoder_seq_length=SEQUENCE_LENGTH,
            forward_only=False,
        )
        # All-reduce the gradients over data-parallel ranks (and of the parameters every TP rank holds
        # whole, such as layernorms, where needed) before the optimizer reads them.
        finalize_model_grads([model])
        _, grad_norm, _ = optimizer.step()
        loss = torch.stack([report["lm loss"] for report in losses_reduced]).mean().item()
        print_rank_0(f"iteration {iteration}: lm loss {loss:.6f} grad norm {grad_norm:.4f}")

    save_checkpoint(checkpoint_dir, model)
    fresh = model_provider().to(device)  # the generator has moved on: different initial weights
    if not differing_tensors(fresh, gpt_model):
        raise RuntimeError("a fresh model equals the trained one, so the reload check would prove nothing")
    mismatched = differing_tensors(load_checkpoint(checkpoint_dir, fresh), gpt_model)
    if mismatched:
        raise RuntimeError(f"the reloaded model differs from the saved one in {mismatched}")
    print_rank_0(f"checkpoint reload check passed: the model loaded from {checkpoint_dir} equals the trained one")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
