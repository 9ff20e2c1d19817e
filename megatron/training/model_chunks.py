"""This rank's model chunks (Megatron-LM's `get_model`): one per virtual pipeline stage, each built by the
model provider for its place in the pipeline (does it embed? compute the loss?), moved to the GPU and wrapped:

    provider(pre_process, post_process[, vp_stage]) -> .cuda() -> Float16Module (--fp16/--bf16) -> DDP

(with FSDP the chunk stays fp32 and is sharded instead: core/distributed/fsdp/mcore_fsdp_adapter.py).
`DistributedDataParallel` holds the contiguous gradient buffers the optimizer and the reduction work on; the
chunks after the first reduce their gradients at the end of the step (no bucketing: off the critical path).
"""

import inspect

import torch

from megatron.core import parallel_state
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import shards_params, wrap_data_parallel
from megatron.core.pipeline_parallel.schedules import get_model_config
from megatron.core.transformer.module import Float16Module
from megatron.training.arguments import ddp_config_from_args
from megatron.training.global_vars import get_args
from megatron.training.parallel_layout import ParallelLayout
from megatron.training.run_callbacks import bind_args


def get_model(model_provider_func, model_type, wrap_with_ddp: bool = True, args=None,
              layout: ParallelLayout | None = None) -> list:
    """Builds this rank's model chunks, one per virtual pipeline stage (one without virtual stages):
    provider -> device -> Float16Module (fp16/bf16) -> DDP (or FSDP). The framework passes `args` and `layout`;
    without them (Megatron-LM's signature, a compatibility entry point) they are the run's `get_args()` and
    `parallel_state`'s. A provider that takes the arguments (run_callbacks.py) gets `args` bound."""
    args = args if args is not None else get_args()
    layout = layout if layout is not None else ParallelLayout.from_parallel_state()
    model_provider_func = bind_args(model_provider_func, args)
    takes_vp_stage = "vp_stage" in inspect.signature(model_provider_func).parameters
    num_chunks = layout.num_model_chunks
    if num_chunks > 1 and not takes_vp_stage:
        raise ValueError("virtual pipeline stages need a model_provider(pre_process, post_process, vp_stage) that "
                         "builds the layers of stage vp_stage")
    model = []
    for vp_stage in range(num_chunks):
        parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage if num_chunks > 1 else None)
        kwargs = {
            "pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        }
        if takes_vp_stage:
            kwargs["vp_stage"] = vp_stage if num_chunks > 1 else None
        chunk = model_provider_func(**kwargs)
        chunk.model_type = model_type
        model.append(chunk)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if num_chunks > 1 else None)
    parameters = sum(p.nelement() for chunk in model for p in chunk.parameters())
    if layout.data_parallel_rank == 0:
        print(
            f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({layout.tensor_parallel_rank}, {layout.pipeline_parallel_rank}): {parameters}",
            flush=True,
        )
    wrapped = []
    for index, chunk in enumerate(model):
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        config = get_model_config(chunk)
        ddp_config = ddp_config_from_args(args)
        # FSDP keeps fp32 params (its main params) and gathers them in the compute dtype.
        if (args.fp16 or args.bf16) and not (wrap_with_ddp and shards_params(ddp_config)):
            chunk = Float16Module(config, chunk)
        if wrap_with_ddp:
            # Chunks after the first reduce their gradients at the end of the step, off the critical path.
            chunk = wrap_data_parallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        wrapped.append(chunk)
    return wrapped
