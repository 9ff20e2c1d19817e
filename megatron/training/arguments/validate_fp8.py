"""FP8 (`--fp8-format e4m3|hybrid`) against the rest of the run (the FP8 flags' own rules are
`LowPrecisionConfig.validate`, megatron/training/config/precision.py).

    needs --bf16 or --fp16; on CUDA a GPU of compute capability 8.9+ (torch._scaled_mm); the GEMM sizes of
    a layer on one TP rank multiples of 16; not with MoE experts (not built yet); --first-last-layers-bf16
    must leave FP8 layers
    --fp8-param-gather (weights stored in FP8): needs --fp8-format and, for training, the distributed
    optimizer, as in Megatron-LM; not with FSDP here
"""

import argparse

import torch

from megatron.core.fp8.recipe import fp8_gemm_size_problems


def _device_problem(flag: str) -> str | None:
    if not torch.cuda.is_available():
        return None  # a CPU run computes the same FP8 products, slowly
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        return None
    return (f"{flag} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) for FP8 GEMMs; "
            f"{torch.cuda.get_device_name()} has {major}.{minor}")


def _check_fp8_param_gather(args: argparse.Namespace, problems: list) -> None:
    if args.fp8 is None:
        problems.append("--fp8-param-gather must be used together with --fp8-format (it stores the weights of the "
                        "FP8 GEMMs in FP8)")
    if args.use_torch_fsdp2:
        problems.append("--fp8-param-gather with --use-torch-fsdp2: Megatron-LM turns it off there (Transformer "
                        "Engine 2 gathers bf16 instead); drop --fp8-param-gather")
    elif args.use_megatron_fsdp:
        problems.append("--fp8-param-gather with --use-megatron-fsdp is not supported yet; use "
                        "--use-distributed-optimizer instead of Megatron-FSDP")
    elif not args.use_distributed_optimizer and torch.is_grad_enabled():
        problems.append("--fp8-param-gather only supported with distributed optimizer (Megatron-LM's rule, which "
                        "also allows FSDP and inference mode): add --use-distributed-optimizer")


def check_fp8(args: argparse.Namespace, problems: list) -> None:
    """Appends the problems of the FP8 flags (after the model shape is derived)."""
    if args.fp8_param_gather:
        _check_fp8_param_gather(args, problems)
    if args.fp8 is None:
        return
    flag = f"--fp8-format {args.fp8}"
    if not (args.bf16 or args.fp16):
        problems.append(f"{flag}: needs --bf16 or --fp16 (the FP8 GEMMs read and write bf16/fp16 activations)")
    device = _device_problem(flag)
    if device:
        problems.append(device)
    if args.num_experts is not None:
        problems.append(f"{flag}: FP8 for MoE experts (--num-experts {args.num_experts}) is not supported yet")
    if args.first_last_layers_bf16 and args.num_layers is not None:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
        if start < 0 or end < 0 or start + end >= args.num_layers:
            problems.append(f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} must be >= 0 "
                            f"each and leave at least one of the {args.num_layers} layers in FP8")
    if None in (args.hidden_size, args.ffn_hidden_size, args.kv_channels, args.num_attention_heads):
        return  # reported by the model-shape checks
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    glu = args.swiglu or args.quick_geglu
    sizes = fp8_gemm_size_problems(args.hidden_size, args.ffn_hidden_size, glu, args.num_attention_heads, groups,
                                   args.kv_channels, args.tensor_model_parallel_size)
    problems.extend(f"{flag}: {problem}" for problem in sizes)
