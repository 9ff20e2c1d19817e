"""A tiny GPT training run built from a Megatron command line, for the checkpoint tests.

Training draws dropout masks from torch's CPU generator (hidden dropout) and from the tensor-parallel
tracker (attention dropout), and the LR warms up, so a resumed run only matches an uninterrupted one
if model, optimizer, scheduler and RNG state all come back exactly.
"""

import random

import numpy as np
import torch

from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import shards_params, wrap_data_parallel
from megatron.core.fp8 import update_fp8_scaling
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.training.arguments import (
    core_transformer_config_from_args,
    ddp_config_from_args,
    optimizer_config_from_args,
    parse_args,
    validate_args,
)

VOCAB_SIZE = 128
BATCH_SIZE = 4
SEQUENCE_LENGTH = 16

BASE_FLAGS = (
    f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 "
    f"--seq-length {SEQUENCE_LENGTH} --max-position-embeddings {SEQUENCE_LENGTH} "
    f"--micro-batch-size {BATCH_SIZE} --global-batch-size {BATCH_SIZE} --train-iters 10 "
    "--lr 1e-2 --min-lr 1e-3 --lr-warmup-iters 3 --lr-decay-style cosine --weight-decay 0.1 "
    "--hidden-dropout 0.1 --attention-dropout 0.1 --seed 1234 --save-interval 1"
    # Most of these tests are about the torch layout (mp_rank_*/model_optim_rng.pt); torch_dist is the
    # default, and its tests pass --ckpt-format torch_dist (the last flag wins).
    " --ckpt-format torch"
).split()


def make_args(*flags):
    """Validated arguments for BASE_FLAGS plus `flags` (the tokenizer's padded vocab set by hand)."""
    args = validate_args(parse_args(args_list=[*BASE_FLAGS, *(str(flag) for flag in flags)]))
    args.padded_vocab_size = VOCAB_SIZE
    return args


def seed_everything(seed: int) -> None:
    """python, numpy, torch and the tensor-parallel tracker streams, as initialize_megatron seeds them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_run(args, seed: int):
    """(model, optimizer, scheduler) freshly initialised from `seed`; the model in DistributedDataParallel
    under --use-distributed-optimizer, in TorchFullyShardedDataParallel under FSDP."""
    seed_everything(seed)
    config = core_transformer_config_from_args(args)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB_SIZE, args.max_position_embeddings)
    ddp_config = ddp_config_from_args(args)
    if args.bf16 and not shards_params(ddp_config):
        model = Float16Module(config, model)
    if args.use_distributed_optimizer or shards_params(ddp_config):
        model = wrap_data_parallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * BATCH_SIZE, lr_decay_steps=args.train_iters * BATCH_SIZE,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * BATCH_SIZE, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, args, first_step: int, num_steps: int) -> list:
    """Trains steps first_step .. first_step + num_steps - 1 (the data depends only on the step number);
    returns the losses and advances args.consumed_train_samples."""
    model.train()
    device = next(model.parameters()).device
    losses = []
    for step in range(first_step, first_step + num_steps):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQUENCE_LENGTH + 1), generator=generator).to(device)
        positions = torch.arange(SEQUENCE_LENGTH, device=device).expand(BATCH_SIZE, -1)
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        if hasattr(model, "finish_grad_sync"):
            finalize_model_grads([model])
        update_fp8_scaling([model])  # the step-end FP8 update the schedules make (nothing without FP8)
        optimizer.step()
        scheduler.step(BATCH_SIZE)
        optimizer.zero_grad()
        args.consumed_train_samples += BATCH_SIZE
        losses.append(loss.item())
    return losses


def rng_snapshot() -> dict:
    """Every generator a checkpoint restores (copies)."""
    snapshot = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        snapshot["cuda"] = torch.cuda.get_rng_state()
    return snapshot


def assert_same(actual, expected, where: str = "state") -> None:
    """Bitwise equality of nested dicts / lists / tuples of tensors, arrays and plain values."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for index, (actual_item, expected_item) in enumerate(zip(actual, expected)):
            assert_same(actual_item, expected_item, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(actual, expected), where
    else:
        assert actual == expected, where


def model_state(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}
