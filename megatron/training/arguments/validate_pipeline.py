"""Pipeline stages: the layer split, virtual stages and the interleaved schedule's microbatch groups.

    layers per pipeline rank = (num_layers [+1 embedding] [+1 loss]) / PP, or
                               --decoder-first/last-pipeline-num-layers on the first/last rank and
                               the rest split evenly over the others
    virtual stages per rank  = layers per rank / --num-layers-per-virtual-pipeline-stage,
                               or --num-virtual-stages-per-pipeline-rank,
                               or the stages of --pipeline-model-parallel-layout / PP (which also places
                               every layer)
    interleaved schedule     PP <= G <= M and M mod G in {0} or >= PP, with M = global batch /
                               (micro batch x DP) microbatches and G = --microbatch-group-size-per-
                               virtual-pipeline-stage (default PP); Megatron-LM's schedule checks it
                               every step, with that step's M (here too): with --step-batch-size-schedule
                               M changes from step to step and is checked only then
"""

import argparse
from types import SimpleNamespace

from megatron.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.training.arguments.reporting import warn_rank_0
from megatron.training.batch_plan import BatchPlan


def _virtual_stages(args, num_layers: int | None, problems: list) -> int | None:
    """Virtual stages per pipeline rank from the flags (None: one, no interleaving)."""
    pp, per_virtual_stage = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_model_parallel_layout is not None:
        try:
            stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        except ValueError as error:
            problems.append(f"--pipeline-model-parallel-layout: {error}")
            return None
        if stages % pp:
            problems.append(f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout} has {stages} "
                            f"stage(s), not a multiple of --pipeline-model-parallel-size {pp}")
            return None
        return stages // pp
    if per_virtual_stage is not None:
        if num_layers is None:
            return None
        counted = num_layers + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
        per_stage = counted // pp
        if counted % pp == 0 and per_stage % per_virtual_stage:
            problems.append(f"{per_stage} layers per pipeline stage (= {counted} / PP {pp}) are not divisible by "
                            f"--num-layers-per-virtual-pipeline-stage {per_virtual_stage}")
            return None
        return per_stage // per_virtual_stage or None
    return args.num_virtual_stages_per_pipeline_rank


def _check_split(args, num_layers: int, virtual_stages: int | None, problems: list) -> None:
    split = SimpleNamespace(
        num_layers=num_layers,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_stages,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        mtp_num_layers=args.mtp_num_layers,
    )
    try:
        pipeline_layer_counts(split)
    except ValueError as error:
        problems.append(f"--num-layers {num_layers} over --pipeline-model-parallel-size "
                        f"{args.pipeline_model_parallel_size}: {error}")


def _check_interleaved_microbatches(args, group: int, problems: list) -> None:
    """The interleaved schedule's group rule, for the full global batch (ramp-up steps are checked when
    they run)."""
    pp = args.pipeline_model_parallel_size
    if not (args.micro_batch_size and args.data_parallel_size) or args.step_batch_size_schedule is not None:
        return  # reported elsewhere, or checked step by step
    plan = BatchPlan.from_args(args)  # the global batch may not be derived yet: one microbatch when unset
    microbatches = plan.num_microbatches
    shown = (f"{microbatches} microbatches (= global batch {plan.global_batch_size} / (micro batch "
             f"{args.micro_batch_size} x DP {args.data_parallel_size}))")
    if not pp <= group <= microbatches:
        problems.append(f"the interleaved schedule needs --pipeline-model-parallel-size {pp} <= "
                        f"--microbatch-group-size-per-virtual-pipeline-stage {group} <= {shown}")
    elif 0 < microbatches % group < pp:
        problems.append(f"the interleaved schedule needs {shown} modulo "
                        f"--microbatch-group-size-per-virtual-pipeline-stage {group} to be 0 or at least "
                        f"--pipeline-model-parallel-size {pp}, got {microbatches % group}")


def derive_pipeline_stages(args: argparse.Namespace, problems: list) -> dict:
    """virtual_pipeline_model_parallel_size and the interleaved schedule's defaults, from flags that passed
    `DistributedConfig.pipeline_flag_problems`; the layer split and the schedule's microbatch groups are
    checked here, where the stages are known."""
    pp = args.pipeline_model_parallel_size
    num_layers = args.num_layers if args.num_layers is not None else args.decoder_num_layers
    virtual_stages = _virtual_stages(args, num_layers, problems)
    if virtual_stages == 1:
        virtual_stages = None
    if virtual_stages is not None and pp == 1:
        problems.append("virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / "
                        "--num-virtual-stages-per-pipeline-rank) need --pipeline-model-parallel-size > 1")
        return {"virtual_pipeline_model_parallel_size": None}
    if num_layers is not None:
        _check_split(args, num_layers, virtual_stages, problems)
    if virtual_stages is None:
        return {"virtual_pipeline_model_parallel_size": None, "overlap_p2p_comm": False, "align_param_gather": False}
    values = {"virtual_pipeline_model_parallel_size": virtual_stages}
    if args.microbatch_group_size_per_vp_stage is None:
        values["microbatch_group_size_per_vp_stage"] = pp
    _check_interleaved_microbatches(args, values.get("microbatch_group_size_per_vp_stage",
                                                     args.microbatch_group_size_per_vp_stage), problems)
    if args.overlap_p2p_comm:
        # Megatron overlaps these transfers by default; the schedule is the same without it, only slower.
        warn_rank_0("pipeline send/receive is not overlapped with compute yet: the interleaved schedule runs as "
                    "with --no-overlap-p2p-communication")
        values["overlap_p2p_comm"] = False
    return values
