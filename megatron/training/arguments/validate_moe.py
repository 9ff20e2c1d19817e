"""Rules between the mixture-of-experts flags and the other sections (the MoE flags' own rules and the
parsing of `--moe-layer-freq` are in megatron/training/config/moe.py, whose `parse_layer_freq` is
importable from here too).

    world size = ETP x EP x expert-DP x PP  (the expert layout must fit the world, as TP x CP x DP x PP does)
"""

import argparse

from megatron.core.model_parallel_config import legal_sizes
from megatron.training.config.moe import parse_layer_freq

__all__ = ["check_moe", "parse_layer_freq"]


def check_moe(args: argparse.Namespace, problems: list) -> None:
    """The experts against the expert-parallel layout, the checkpoint format, the biases and the layers."""
    ep, etp, tp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if etp < 1:
        return  # reported by the parallel layout
    if args.num_experts is None:
        if ep > 1:
            problems.append(f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    if ep >= 1 and args.num_experts % ep:
        problems.append(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
                        f"valid EP sizes: {legal_sizes(args.num_experts)}")
    expert_model_size = etp * ep * args.pipeline_model_parallel_size
    if expert_model_size >= 1 and args.world_size % expert_model_size:
        problems.append(f"world size {args.world_size} is not divisible by expert TP {etp} x EP {ep} x PP "
                        f"{args.pipeline_model_parallel_size} = {expert_model_size}")
    torch_files = (args.ckpt_format == "torch" and (args.save or args.load)) or args.ckpt_convert_format == "torch"
    if tp % etp and torch_files:
        problems.append(f"--ckpt-format torch names each file by tensor and expert rank (mp_rank_TT_EEE), which "
                        f"needs --expert-tensor-parallel-size {etp} to divide --tensor-model-parallel-size {tp}; "
                        f"use --ckpt-format torch_dist")
    if args.add_bias_linear and args.moe_grouped_gemm:
        problems.append("--moe-grouped-gemm has no expert biases (as in Megatron-LM): add --disable-bias-linear, or "
                        "leave out --moe-grouped-gemm to run the experts one by one")
    if args.add_bias_linear and args.moe_shared_expert_intermediate_size is not None:
        problems.append("--moe-shared-expert-intermediate-size: shared experts have no biases (as in Megatron-LM); "
                        "add --disable-bias-linear")
    if args.moe_router_load_balancing_type == "sinkhorn" and args.moe_aux_loss_coeff:
        problems.append(f"--moe-router-load-balancing-type sinkhorn has no auxiliary loss (Megatron-LM's rule): drop "
                        f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff}")
    freq = args.moe_layer_freq
    if isinstance(freq, list) and args.num_layers is not None and len(freq) != args.num_layers:
        problems.append(f"--moe-layer-freq has {len(freq)} entries but --num-layers is {args.num_layers}")
