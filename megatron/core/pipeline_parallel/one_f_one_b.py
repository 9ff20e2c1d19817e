"""The 1F1B pipeline schedule (`forward_backward_pipelining_without_interleaving`).

Stage p of P runs M microbatches in three phases (reference 9.4):

    warm-up     W = min(P - p - 1, M) forwards, each output sent downstream
    steady      M - W times: one forward, then one backward (of the oldest microbatch in flight)
    cool-down   the W remaining backwards

so at most W + 1 microbatches hold activations on stage p. Example, P = 2, M = 3 (F = forward,
B = backward, digits = microbatch):

    stage 0:  F0  F1  B0  F2  B1  B2
    stage 1:  F0  B0  F1  B1  F2  B2
"""

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.grad_sync import GradSyncSwitch, finalize_gradients, new_token_count
from megatron.core.pipeline_parallel.microbatch_step import (
    backward_step,
    deallocate_output_tensor,
    forward_step,
    get_model_config,
    timed_schedule,
)


def _single(value, what: str):
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(
                f"the non-interleaved pipeline schedule takes one {what}, got {len(value)}; several model chunks "
                "need virtual pipeline stages (the interleaved schedule)"
            )
        return value[0]
    return value


@timed_schedule
def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
):
    """Runs the 1F1B schedule on this stage; returns the last stage's loss reports (empty elsewhere)."""
    model = _single(model, "model chunk")
    data_iterator = _single(data_iterator, "data iterator")
    if collect_non_loss_data:
        raise ValueError("collect_non_loss_data is not supported yet")
    config = get_model_config(model)
    if config.overlap_p2p_comm:
        raise ValueError(
            "overlap_p2p_comm needs the interleaved schedule (virtual pipeline stages); the 1F1B schedule "
            "communicates without overlap"
        )
    rank = parallel_state.get_pipeline_model_parallel_rank()
    size = parallel_state.get_pipeline_model_parallel_world_size()
    is_last_stage = parallel_state.is_pipeline_last_stage()
    shape = p2p.pipeline_tensor_shape(config, seq_length, micro_batch_size)
    num_warmup = num_microbatches if forward_only else min(size - rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup

    grad_sync = GradSyncSwitch(config)
    grad_sync.disable()
    forward_data_store, input_tensors, output_tensors = [], [], []
    total_num_tokens = new_token_count()

    def forward(input_tensor):
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
            is_last_stage=is_last_stage,
        )
        total_num_tokens.add_(num_tokens)
        return output_tensor

    def keep_for_backward(input_tensor, output_tensor):
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        if not is_last_stage:
            deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    def backward(output_tensor_grad):
        return backward_step(input_tensors.pop(0), output_tensors.pop(0), output_tensor_grad, config)

    with torch.set_grad_enabled(not forward_only):
        for _ in range(num_warmup):
            input_tensor = p2p.recv_forward(shape, config)
            output_tensor = forward(input_tensor)
            p2p.send_forward(output_tensor, shape, config)
            if not forward_only:
                keep_for_backward(input_tensor, output_tensor)

        # forward_only runs every microbatch in the warm-up loop: the steady state always trains.
        input_tensor = p2p.recv_forward(shape, config) if num_steady > 0 else None
        for step in range(num_steady):
            last_step = step == num_steady - 1
            output_tensor = forward(input_tensor)
            output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, shape, config)
            keep_for_backward(input_tensor, output_tensor)
            if last_step and num_warmup == 0:
                grad_sync.enable()  # the last backward of this stage: the reduction may start
            input_tensor_grad = backward(output_tensor_grad)
            if last_step:
                p2p.send_backward(input_tensor_grad, shape, config)
            else:
                input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, shape, config)

        if not forward_only:
            for step in range(num_warmup):
                if step == num_warmup - 1:
                    grad_sync.enable()
                output_tensor_grad = p2p.recv_backward(shape, config)
                input_tensor_grad = backward(output_tensor_grad)
                p2p.send_backward(input_tensor_grad, shape, config)

    grad_sync.enable()
    if not forward_only:
        finalize_gradients(config, [model], total_num_tokens)
    return forward_data_store
