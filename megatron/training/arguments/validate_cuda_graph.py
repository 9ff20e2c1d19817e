"""`--cuda-graph-impl`: what a full-iteration CUDA graph can replay, checked before anything is built.

A captured iteration (megatron/core/full_cuda_graph.py) replays fixed kernels on fixed addresses, so it
needs fixed shapes, no host reads of device values and no generator swaps inside the forward and backward
passes, and (for now) one process. Each run setting that breaks one of those is named with the reason
(the CUDA-graph flags' own rules are `KernelFusionConfig.validate`, megatron/training/config/model.py).
"""

import torch


def check_cuda_graph(args, problems: list) -> None:
    """What a full-iteration graph cannot replay in this run: the device, the world size, the model, the
    recomputation and the batch schedule."""
    if args.cuda_graph_impl != "full_iteration":
        return
    if not torch.cuda.is_available():
        problems.append("--cuda-graph-impl full_iteration needs a CUDA device")
    reasons = {
        f"world size {args.world_size}": args.world_size > 1,  # collectives inside the graph: not yet
        "--num-experts (MoE routing reads token counts on the host)": args.num_experts is not None,
        f"--attention-dropout {args.attention_dropout} (its per-rank random stream is swapped in on the host)":
            args.attention_dropout > 0,
        f"--recompute-granularity {args.recompute_granularity} (recomputation replays random states)":
            args.recompute_granularity is not None,
        "--rampup-batch-size (the number of micro batches changes)": args.rampup_batch_size is not None,
    }
    for reason, applies in reasons.items():
        if applies:
            problems.append(f"--cuda-graph-impl full_iteration is not supported yet with {reason}")
