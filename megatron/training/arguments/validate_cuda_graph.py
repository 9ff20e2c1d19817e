"""`--cuda-graph-impl`: what a full-iteration CUDA graph can replay, checked before anything is built.

A captured iteration (megatron/core/full_cuda_graph.py) replays fixed kernels on fixed addresses, so it
needs fixed shapes, no host reads of device values and no generator swaps inside the forward and backward
passes, and (for now) no parallelism but tensor parallelism, whose collectives it replays. Each run setting
that breaks one of those is named with the reason (the CUDA-graph flags' own rules are
`KernelFusionConfig.validate`, megatron/training/config/model.py).
"""

import torch


def check_cuda_graph(args, problems: list) -> None:
    """What a full-iteration graph cannot replay in this run: the device, the world size, the model, the
    recomputation and the batch schedule."""
    if args.cuda_graph_impl != "full_iteration":
        return
    if not torch.cuda.is_available():
        problems.append("--cuda-graph-impl full_iteration needs a CUDA device")
    tensor_parallel = args.tensor_model_parallel_size
    model_size = tensor_parallel * args.pipeline_model_parallel_size * args.context_parallel_size
    reasons = {
        # Tensor-parallel collectives are kernels on the compute stream, --tp-comm-overlap's on side streams
        # forked from and joined to it (its two implementations capture and replay exactly:
        # tools/bench/tp_overlap_check.py): the graph replays them. Gradient
        # reduction across data-parallel ranks is driven by host-side bucket bookkeeping, the pipeline by
        # host-ordered sends and receives, ring attention by host-side chunk scheduling.
        f"data-parallel size {args.world_size // model_size} (world size {args.world_size})":
            args.world_size > model_size,
        f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}": args.pipeline_model_parallel_size > 1,
        f"--context-parallel-size {args.context_parallel_size}": args.context_parallel_size > 1,
        f"--hidden-dropout {args.hidden_dropout} at --tensor-model-parallel-size {tensor_parallel} (the "
        "tensor-parallel random stream is swapped in on the host)": tensor_parallel > 1 and args.hidden_dropout > 0,
        "--num-experts (MoE routing reads token counts on the host)": args.num_experts is not None,
        f"--attention-dropout {args.attention_dropout} (its per-rank random stream is swapped in on the host)":
            args.attention_dropout > 0,
        f"--recompute-granularity {args.recompute_granularity} (recomputation replays random states)":
            args.recompute_granularity is not None,
        "--rampup-batch-size (the number of micro batches changes)": args.rampup_batch_size is not None,
        "--step-batch-size-schedule (the number of micro batches changes)": args.step_batch_size_schedule is not None,
        "--rerun-mode validate_results (the loss is validated on the host)": args.rerun_mode == "validate_results",
    }
    for reason, applies in reasons.items():
        if applies:
            problems.append(f"--cuda-graph-impl full_iteration is not supported yet with {reason}")
