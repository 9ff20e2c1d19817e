"""Megatron-LM's rules for its communication-overlap and scheduling options that change only its speed
(accepted here, each with a line saying what happens instead: without_effect.py). A command line that
Megatron-LM refuses is refused here too, with the same rule."""

import argparse


def check_overlap_options(args: argparse.Namespace, problems: list) -> None:
    instances = args.num_distributed_optimizer_instances
    if instances < 1:
        problems.append(f"--num-distributed-optimizer-instances {instances} must be at least 1")
    elif instances > 1:
        if not args.use_distributed_optimizer:
            problems.append(f"--num-distributed-optimizer-instances {instances} needs --use-distributed-optimizer")
        dp = args.data_parallel_size
        if dp is not None and dp % instances:
            problems.append(f"--num-distributed-optimizer-instances {instances} must divide the data-parallel size "
                            f"{dp}")
    if args.overlap_param_gather_with_optimizer_step:
        needed = [flag for flag, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                        ("--overlap-param-gather", args.overlap_param_gather),
                                        ("virtual pipeline stages", args.virtual_pipeline_model_parallel_size))
                  if not on]
        if needed:
            problems.append(f"--overlap-param-gather-with-optimizer-step needs {' and '.join(needed)}")
    if args.defer_embedding_wgrad_compute:
        if args.pipeline_model_parallel_size == 1:
            problems.append("--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1")
        if not args.gradient_accumulation_fusion:
            problems.append("--defer-embedding-wgrad-compute cannot go with --no-gradient-accumulation-fusion")
        if args.wgrad_deferral_limit < 0:
            problems.append(f"--wgrad-deferral-limit {args.wgrad_deferral_limit} must be >= 0")
    if args.overlap_moe_expert_parallel_comm:
        if args.expert_model_parallel_size <= 1:
            problems.append("--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1")
        if args.moe_token_dispatcher_type not in ("alltoall", "flex"):
            problems.append(f"--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall, got "
                            f"{args.moe_token_dispatcher_type}")
        if args.recompute_granularity == "full":
            problems.append("--overlap-moe-expert-parallel-comm cannot go with --recompute-granularity full")
        if not (args.bf16 or args.fp16):
            problems.append("--overlap-moe-expert-parallel-comm needs --bf16 or --fp16")
    if args.delay_wgrad_compute:
        if not args.overlap_moe_expert_parallel_comm:
            problems.append("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm")
        if args.transformer_impl != "transformer_engine":
            problems.append(f"--delay-wgrad-compute needs --transformer-impl transformer_engine (Megatron-LM's "
                            f"rule), got {args.transformer_impl}")
    if args.overlap_p2p_comm_warmup_flush and args.virtual_pipeline_model_parallel_size is None:
        problems.append("--overlap-p2p-communication-warmup-flush needs virtual pipeline stages (the interleaved "
                        "schedule, whose transfers Megatron-LM overlaps)")
