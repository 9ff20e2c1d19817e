"""Fully sharded data parallelism against the rest of the run: --use-torch-fsdp2, and --use-megatron-fsdp with its
--data-parallel-sharding-strategy (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py says what each builds).

    no_shard            DDP                               --use-distributed-optimizer turned off
    optim               DDP + the distributed optimizer   --use-distributed-optimizer turned on (as Megatron-LM)
    optim_grads         DDP's buffers with sharded gradients + the distributed optimizer (turned on)
    optim_grads_params  DDP's buffers with sharded gradients and params + the distributed optimizer (turned on)

(the optimizer each strategy takes is derived in the distributed section, config/parallel.py). FSDP2 overlaps
its all-gathers and reduce-scatters with compute by itself, and optim_grads / optim_grads_params always overlap
(as Megatron-FSDP turns the overlap flags on for them): --overlap-grad-reduce and --overlap-param-gather are
accepted and change nothing there. Unlike Megatron-LM, both sharding the params here combine with pipeline
parallelism (also interleaved) and with tied embeddings.
"""

import argparse
import os

import torch

from megatron.training.arguments.reporting import warn_rank_0

_MEGATRON_FSDP_DTYPE_FLAGS = {"megatron_fsdp_main_params_dtype": ("--megatron-fsdp-main-params-dtype", torch.float32),
                              "megatron_fsdp_main_grads_dtype": ("--megatron-fsdp-main-grads-dtype", None),
                              "megatron_fsdp_grad_comm_dtype": ("--megatron-fsdp-grad-comm-dtype", None)}

_PARAMS_SHARDED = ("optim_grads_params",)


def _params_sharding_flag(args) -> str | None:
    """The flags that shard the params (FSDP2 or Megatron-FSDP's ZeRO-3; None: they are not)."""
    if args.use_torch_fsdp2 and not args.use_megatron_fsdp:
        return "--use-torch-fsdp2"
    if args.use_megatron_fsdp and not args.use_torch_fsdp2 and args.data_parallel_sharding_strategy in _PARAMS_SHARDED:
        return f"--use-megatron-fsdp --data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}"
    return None


def check_fsdp(args: argparse.Namespace, problems: list) -> None:
    """What sharding the params does not combine with yet; the other strategies take what DDP takes."""
    flag = _params_sharding_flag(args)
    if flag is None:
        return
    if args.expert_model_parallel_size > 1:
        problems.append(f"{flag} with --expert-model-parallel-size {args.expert_model_parallel_size} is not "
                        "supported yet (as in Megatron-LM)")
    instances = args.num_distributed_optimizer_instances
    if args.use_megatron_fsdp and instances > 1:
        problems.append(f"{flag} with --num-distributed-optimizer-instances {instances} is not supported yet")
    if args.fp16:
        problems.append(f"{flag} with --fp16 is not supported yet (as in Megatron-LM): use --bf16")
    if args.use_precision_aware_optimizer:
        problems.append(f"{flag} with --use-precision-aware-optimizer is not supported yet")
    if args.ckpt_format != "torch_dist" and (args.save is not None or args.load is not None):
        problems.append(f"{flag} saves and loads --ckpt-format torch_dist only (each data-parallel rank holds "
                        f"other rows of every param), not --ckpt-format {args.ckpt_format}")
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        # Megatron-LM refuses this; the run is right either way, only slower.
        warn_rank_0(f"{flag}: CUDA_DEVICE_MAX_CONNECTIONS=1 serialises FSDP's all-gathers and reduce-scatters with "
                    "the compute (they run on streams of their own); unset it unless tensor parallelism needs it")


def check_megatron_fsdp_dtypes(args: argparse.Namespace, problems: list) -> None:
    """--megatron-fsdp-*-dtype: the dtypes the strategy's wrapper builds (mcore_fsdp_adapter.py), or a line
    saying the flag has no effect without --use-megatron-fsdp (Megatron-LM reads it only there)."""
    if not args.use_megatron_fsdp:
        for dest, (flag, default) in _MEGATRON_FSDP_DTYPE_FLAGS.items():
            if getattr(args, dest) != default:
                warn_rank_0(f"{flag} has no effect without --use-megatron-fsdp (as in Megatron-LM)")
        return
    # Imported here: the wrappers load the model code, which parsing alone does not need.
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import megatron_fsdp_dtype_mismatches

    problems += megatron_fsdp_dtype_mismatches(args, args.accumulate_allreduce_grads_in_fp32, args.params_dtype)
