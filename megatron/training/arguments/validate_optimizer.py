"""--optimizer muon against the rest of the run (Megatron-LM's rules), and what it turns into.

Megatron-LM turns --use-distributed-optimizer off under Muon (and reads the older --optimizer dist_muon as
--optimizer muon --use-distributed-optimizer): its gradients are then all-reduced and a layer-wise distributed
optimizer shards the optimizer state over the data-parallel ranks, each rank updating whole params and sending them
to the others. That sharding is not built here: every data-parallel rank keeps the whole state and computes the same
update (one line says so). Muon's own options are checked where they are used (megatron/core/optimizer/muon.py).
"""

import argparse

from megatron.core.optimizer.muon import muon_option_problems
from megatron.training.arguments.reporting import print_rank_0


def muon_values(view) -> dict:
    """--optimizer dist_muon as muon, and the distributed optimizer off under Muon (module docstring)."""
    if view.optimizer not in ("muon", "dist_muon"):
        return {}
    if view.optimizer == "dist_muon":
        print_rank_0("WARNING: --optimizer dist_muon is deprecated (Megatron-LM): it means --optimizer muon "
                     "--use-distributed-optimizer")
    if view.optimizer == "dist_muon" or view.use_distributed_optimizer:
        print_rank_0("note: --use-distributed-optimizer with --optimizer muon: Megatron-LM shards Muon's and Adam's "
                     "state layer by layer over the data-parallel ranks (its layer-wise distributed optimizer); here "
                     "every data-parallel rank keeps the whole state and computes the same updates (more memory per "
                     "rank, the same results)")
    return {"optimizer": "muon", "use_distributed_optimizer": False}


def check_muon(args: argparse.Namespace, problems: list) -> None:
    """What Megatron-LM refuses with Muon, what is not built with it yet, and its options."""
    if args.optimizer != "muon":
        return
    problems += muon_option_problems(args.muon_fp32_matmul_prec, args.muon_coefficient_type, args.muon_num_ns_steps,
                                     args.muon_scale_mode, args.muon_tp_mode)
    refused = {
        "--fp16 (as in Megatron-LM): use --bf16": args.fp16,
        "--use-torch-fsdp2 (as in Megatron-LM)": args.use_torch_fsdp2,
        "--use-megatron-fsdp (as in Megatron-LM)": args.use_megatron_fsdp,
        f"--ckpt-format {args.ckpt_format} (as in Megatron-LM): use torch_dist or torch":
            args.ckpt_format not in ("torch", "torch_dist"),
        "--overlap-param-gather (the params of Megatron-LM's layer-wise distributed optimizer are gathered by "
        "it)": args.overlap_param_gather,
        "--use-precision-aware-optimizer": args.use_precision_aware_optimizer,
        "--optimizer-cpu-offload": args.optimizer_cpu_offload,
    }
    problems += [f"--optimizer muon is not supported with {what}" for what, given in refused.items() if given]
    if args.muon_scalar_optimizer != "adam":
        problems.append(f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not supported yet; use adam")
