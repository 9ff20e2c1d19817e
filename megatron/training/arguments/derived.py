"""Every value validation writes into the arguments, computed once, with Megatron's notes about them.

Each section derives its own (`derived()` of the sections under megatron/training/config/: the default
widths, the parameters' dtype, ...); `derive_values` adds those that need several sections:

    data_parallel_size = world size / (TP x PP x CP)
    global_batch_size  = micro batch x DP when unset (one microbatch per step); the evaluation batches
                         default to the training ones (the batch plan's defaults, batch_plan.py)
    virtual pipeline stages and the interleaved schedule's defaults (validate_pipeline.py)
    --optimizer muon: the distributed optimizer off, dist_muon as muon (validate_optimizer.py)
    couplings: no RoPE fusion without RoPE, no bias-GELU fusion without biases, the experts' width
    defaulting to the MLP's, no NaN check under fp16 dynamic loss scaling, --load from --save with
    --auto-resume
"""

import argparse

import torch

from megatron.training.arguments.reporting import print_rank_0, warn_rank_0
from megatron.training.arguments.validate_optimizer import muon_values
from megatron.training.arguments.validate_parallel import describe_data_parallel_size, world_size_problem
from megatron.training.arguments.validate_pipeline import derive_pipeline_stages
from megatron.training.batch_plan import BatchPlan
from megatron.training.config.run_config import RunConfig


def _parallel_values(config: RunConfig, view, problems: list) -> dict:
    distributed = config.distributed
    data_parallel_size = distributed.data_parallel_size(view.world_size)
    if not distributed.size_problems():
        if data_parallel_size is None:
            problems.append(world_size_problem(view))
        else:
            print_rank_0(f"using world size: {view.world_size}, data-parallel size: {data_parallel_size}, "
                         f"context-parallel size: {distributed.context_parallel_size}, "
                         f"tensor-model-parallel size: {distributed.tensor_model_parallel_size}, "
                         f"pipeline-model-parallel size: {distributed.pipeline_model_parallel_size}")
    if distributed.sequence_parallel and not distributed.effective_sequence_parallel:
        warn_rank_0("disabling --sequence-parallel because --tensor-model-parallel-size is 1")
    return {"data_parallel_size": data_parallel_size}


def _model_values(config: RunConfig, view) -> dict:
    network = config.network_size
    if not network.group_query_attention and network.num_query_groups != 1:
        warn_rank_0(f"--num-query-groups {network.num_query_groups} is ignored without --group-query-attention "
                    f"(Megatron's rule): every head gets its own key/value head")
    values = {
        "apply_rope_fusion": view.apply_rope_fusion and view.position_embedding_type == "rope",
        "bias_gelu_fusion": view.bias_gelu_fusion and view.add_bias_linear,
    }
    if view.num_experts is not None and view.moe_ffn_hidden_size is None:
        values["moe_ffn_hidden_size"] = view.ffn_hidden_size
    return values


def _batch_values(view) -> dict:
    """The global batch when unset and the evaluation batches, as the batch plan defaults them."""
    mbs, dp = view.micro_batch_size, view.data_parallel_size
    if mbs is None or mbs < 1 or dp is None:
        return {}  # reported by the training flags or the parallel layout
    try:
        plan = BatchPlan.from_args(view)
    except ValueError:
        return {}  # a malformed --step-batch-size-schedule, reported by the batch checks
    values = {}
    if view.global_batch_size is None:
        values["global_batch_size"] = plan.global_batch_size
        print_rank_0(f"setting global batch size to {plan.global_batch_size} "
                     f"(= micro batch size {mbs} x {describe_data_parallel_size(view)})")
    if plan.global_batch_size >= 1 and plan.whole_microbatches:
        print_rank_0(f"global batch size {plan.global_batch_size} = micro batch size {mbs} x "
                     f"{plan.num_microbatches} microbatches x data parallel size {dp}")
    # Evaluation batches default to the training ones (Megatron-LM's rule).
    if view.eval_micro_batch_size is None:
        values["eval_micro_batch_size"] = plan.eval_micro
    if view.eval_global_batch_size is None:
        values["eval_global_batch_size"] = plan.eval_global
    return values


def _precision_values(config: RunConfig, values: dict) -> dict:
    precision = config.mixed_precision
    derived = {}
    if precision.dynamic_loss_scaling:
        # With dynamic loss scaling an inf/nan gradient is the scaler's signal, not an error.
        derived["check_for_nan_in_loss_and_grad"] = False
        print_rank_0("WARNING: Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss "
                     "scaling is being used")
    if values["params_dtype"] == torch.bfloat16 and config.optimizer.main_grads_dtype == "bf16":
        # Megatron-LM's rule: bf16 main gradients leave the gradients in bf16 (only with the precision-aware
        # optimizer; its check reports the other cases).
        derived["accumulate_allreduce_grads_in_fp32"] = precision.accumulate_allreduce_grads_in_fp32
    elif values["accumulate_allreduce_grads_in_fp32"] and not precision.accumulate_allreduce_grads_in_fp32:
        print_rank_0("accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    print_rank_0(f"using {values['params_dtype']} for parameters ...")
    return derived


def _data_and_checkpoint_values(config: RunConfig, values: dict) -> dict:
    if "split" in values:
        warn_rank_0(f'Please specify --split when using --data-path. Using legacy default value of '
                    f'"{values["split"]}"')
    checkpointing = config.checkpointing
    if config.resilience.auto_resume and checkpointing.save is not None and checkpointing.load is None:
        return {"load": checkpointing.save}  # --auto-resume resumes from --save
    return {}


def derive_values(config: RunConfig, world_size: int, problems: list) -> dict:
    """{dest: value} of every derived argument. A value that cannot be derived (a world size that the
    layout does not divide, virtual stages that do not split the layers) is left out or None, with a
    problem appended to `problems`; the sections' own problems are reported by their `validate()`."""
    values = {}
    for section in config.sections():
        values.update(section.derived())
    view = argparse.Namespace(**config.as_dict(), world_size=world_size)
    view.__dict__.update(values)

    def add(more: dict) -> None:
        values.update(more)
        view.__dict__.update(more)

    add(_parallel_values(config, view, problems))
    add(_model_values(config, view))
    distributed = config.distributed
    if distributed.pipeline_model_parallel_size >= 1 and not distributed.pipeline_flag_problems():
        add(derive_pipeline_stages(view, problems))
    else:
        add({"virtual_pipeline_model_parallel_size": None})
    add(muon_values(view))
    add(_batch_values(view))
    add(_precision_values(config, values))
    add(_data_and_checkpoint_values(config, values))
    return values
