"""Losses are computed on the last pipeline stage only; this hands them to the other stages.

The console line and TensorBoard are written by the last rank, which is on the last stage, but callers of
`train_step` / `evaluate` on any rank (exit and bad-step checks, library users) should see the same
values, so the reduced losses are broadcast over the pipeline group (one small broadcast per step,
only when PP > 1).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state


def broadcast_from_last_stage(losses: dict) -> dict:
    """`losses` ({name: scalar tensor or float}) of the last pipeline stage, on every stage (as 0-dim
    float tensors on the other stages, on the device of the collectives, where the last stage's are)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return losses
    is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    payload = [{name: float(value) for name, value in losses.items()} if is_last_stage else None]
    dist.broadcast_object_list(
        payload, src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    if is_last_stage:
        return losses
    device = parallel_state.collective_device()
    return {name: torch.tensor(value, device=device) for name, value in payload[0].items()}
