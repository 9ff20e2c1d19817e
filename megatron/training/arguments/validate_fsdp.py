"""Fully sharded data parallelism: --use-torch-fsdp2, and --use-megatron-fsdp with its
--data-parallel-sharding-strategy (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py says what each builds).

    no_shard            DDP                               --use-distributed-optimizer turned off
    optim               DDP + the distributed optimizer   --use-distributed-optimizer turned on (as Megatron-LM)
    optim_grads         FSDP2, params kept gathered from each layer's forward to its backward
    optim_grads_params  FSDP2 (as --use-torch-fsdp2)

FSDP2 overlaps its all-gathers and reduce-scatters with compute by itself: --overlap-grad-reduce and
--overlap-param-gather are accepted and change nothing there. Unlike Megatron-LM, FSDP2 here combines with
pipeline parallelism (also interleaved) and with tied embeddings.
"""

import argparse
import os

from megatron.training.arguments.reporting import print_rank_0, warn_rank_0

_PARAMS_SHARDED = ("optim_grads", "optim_grads_params")


def _megatron_fsdp_strategy(args) -> bool:
    """Sets the optimizer the strategy takes; returns whether FSDP2 shards the params."""
    strategy = args.data_parallel_sharding_strategy
    wants_distributed_optimizer = strategy == "optim"
    if args.use_distributed_optimizer != wants_distributed_optimizer:
        print_rank_0(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}: "
                     f"{'using' if wants_distributed_optimizer else 'not using'} the distributed optimizer")
        args.use_distributed_optimizer = wants_distributed_optimizer
    if strategy == "no_shard" and args.overlap_param_gather:
        print_rank_0("--overlap-param-gather: no_shard gathers no params (the gradient all-reduce overlaps)")
        args.overlap_param_gather = False
    return strategy in _PARAMS_SHARDED


def check_fsdp(args: argparse.Namespace, problems: list) -> None:
    """What the two FSDP flags combine with; the Megatron-FSDP strategy decides the optimizer."""
    if args.use_torch_fsdp2 and args.use_megatron_fsdp:
        problems.append("--use-torch-fsdp2 and --use-megatron-fsdp are two implementations of FSDP: choose one")
        return
    if args.use_megatron_fsdp:
        if not _megatron_fsdp_strategy(args):
            return
        flag = f"--use-megatron-fsdp --data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}"
    elif args.use_torch_fsdp2:
        flag = "--use-torch-fsdp2"
        if args.use_distributed_optimizer:
            problems.append("--use-torch-fsdp2 shards the optimizer state itself: drop --use-distributed-optimizer")
    else:
        return
    if args.expert_model_parallel_size > 1:
        problems.append(f"{flag} with --expert-model-parallel-size {args.expert_model_parallel_size} is not "
                        "supported yet (as in Megatron-LM)")
    if args.fp16:
        problems.append(f"{flag} with --fp16 is not supported yet (as in Megatron-LM): use --bf16")
    if args.use_precision_aware_optimizer:
        problems.append(f"{flag} with --use-precision-aware-optimizer is not supported yet")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        # Megatron-LM refuses this; the run is right either way, only slower.
        warn_rank_0(f"{flag}: CUDA_DEVICE_MAX_CONNECTIONS=1 serialises FSDP's all-gathers and reduce-scatters with "
                    "the compute (they run on streams of their own); unset it unless tensor parallelism needs it")
    if args.ckpt_format != "torch_dist" and (args.save is not None or args.load is not None):
        problems.append(f"{flag} saves and loads --ckpt-format torch_dist only (each data-parallel rank holds "
                        f"other rows of every param), not --ckpt-format {args.ckpt_format}")
