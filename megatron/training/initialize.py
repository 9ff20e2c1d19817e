"""`initialize_megatron`: arguments, torch.distributed, parallel groups, seeds and run-wide objects.

Works under torchrun (ranks from the environment, `env://`) and as a plain `python pretrain_gpt.py` (a
one-process group on a free local port). The backend is NCCL on GPUs and gloo on a machine without CUDA,
whatever `--distributed-backend` says, with a note when the request is overridden.
"""

import importlib
import logging
import os
import random
import socket
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.timers import Timers
from megatron.core.tokenizers import construct_tokenizer, padded_vocab_size
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.batch_plan import BatchPlan
from megatron.training.checkpointing import load_args_from_checkpoint
from megatron.training.console import print_rank_0
from megatron.training.determinism import apply_deterministic_mode


def parse_and_validate_args(extra_args_provider=None, args_defaults: dict | None = None,
                            ignore_unknown_args: bool = False):
    """The command line parsed and validated, and made the run's `get_args()` (Megatron-LM's
    `parse_and_validate_args`); with --use-checkpoint-args the model's shape comes from the checkpoint, before
    validation derives anything."""
    args = parse_args(extra_args_provider, ignore_unknown_args)
    if args.use_checkpoint_args or (args_defaults or {}).get("use_checkpoint_args", False):
        if args.load is None:
            raise ValueError("--use-checkpoint-args needs --load")
        args, _ = load_args_from_checkpoint(args)
    validate_args(args, args_defaults or {})
    global_vars.set_args(args)
    return args


def initialize_megatron(
    extra_args_provider=None,
    args_defaults: dict | None = None,
    ignore_unknown_args: bool = False,
    allow_no_cuda: bool = True,
    skip_mpu_initialization: bool = False,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    parsed_args=None,
):
    """Sets up everything a run needs from validated arguments (`parsed_args`, else the command line's):
    torch.distributed and the parallel groups, seeds, the microbatch calculator, the tokenizer, timers and
    writers. With `skip_mpu_initialization` it stops after the arguments. Returns the arguments."""
    args = parsed_args
    if args is None:
        args = parse_and_validate_args(extra_args_provider, args_defaults, ignore_unknown_args)
    global_vars.set_args(args)
    if skip_mpu_initialization:
        return args

    _set_logging_level(args)
    apply_deterministic_mode(args)

    _initialize_distributed(args, get_embedding_ranks, get_position_embedding_ranks)
    set_random_seed(args.seed, args.data_parallel_random_init)
    BatchPlan.from_args(args).install(dist.get_rank())
    tokenizer = construct_tokenizer(args)
    # The model's vocabulary rows, decided once here; model providers (ours and those written for
    # Megatron-LM) read them as args.padded_vocab_size.
    args.padded_vocab_size = padded_vocab_size(args, tokenizer)
    global_vars.set_tokenizer(tokenizer)
    global_vars.set_timers(Timers(args.timing_log_level, args.timing_log_option))
    _set_writers(args)
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _initialize_distributed(args, get_embedding_ranks, get_position_embedding_ranks) -> None:
    backend = args.distributed_backend
    if not torch.cuda.is_available() and backend == "nccl":
        print_rank_0("note: no CUDA device; using the gloo backend on the CPU instead of nccl")
        backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        # torch.distributed.nn's functions take `group=group.WORLD` as a default, evaluated when it is imported:
        # imported after init_process_group (torch.optim loads it through torch._dynamo) they would keep the world
        # group alive past destroy_process_group, its gloo worker threads with it (training.py's _shut_down).
        importlib.import_module("torch.distributed.nn")

        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
            )
    if dist.get_world_size() != args.world_size:
        raise ValueError(
            f"torch.distributed has {dist.get_world_size()} ranks but the arguments were validated for "
            f"{args.world_size} (WORLD_SIZE={os.environ.get('WORLD_SIZE')})"
        )
    args.rank = dist.get_rank()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        nccl_communicator_config_path=args.nccl_communicator_config_path,
        high_priority_stream_groups=args.high_priority_stream_groups,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
    )


def _set_logging_level(args) -> None:
    """The root logger's level: --logging-level, else the MEGATRON_LOGGING_LEVEL variable, else untouched
    (Megatron's precedence)."""
    level = args.logging_level
    if level is None and os.getenv("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        print_rank_0(f"setting logging level to {level}")
        logging.getLogger().setLevel(level)


def set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron's seeding: `seed + 100 * pp_rank` (+ `10 * dp_rank`) for python, numpy, torch and the
    tensor-parallel RNG tracker, so pipeline stages draw different weights and TP ranks agree."""
    if seed is None or seed <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed}")
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed = seed + 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _set_writers(args) -> None:
    """TensorBoard and W&B writers live on the last rank, which holds the loss (Megatron's choice)."""
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    if args.log_memory_to_tensorboard and not torch.cuda.is_available():
        print("note: --log-memory-to-tensorboard writes the CUDA allocator's statistics; without a CUDA device "
              "there are none to write", flush=True)
    if args.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        global_vars.set_tensorboard_writer(
            SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        )
    if getattr(args, "wandb_project", ""):
        try:
            import wandb
        except ImportError:
            print("warning: --wandb-project is set but wandb is not installed (pip install wandb)", file=sys.stderr)
            return
        save_dir = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        global_vars.set_wandb_writer(
            wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project, entity=args.wandb_entity,
                       config=vars(args))
        )
