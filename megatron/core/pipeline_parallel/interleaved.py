"""The interleaved 1F1B schedule (`forward_backward_pipelining_with_interleaving`, reference 9.4).

Each of the P pipeline ranks holds v model chunks (virtual stages); chunk k of rank p is virtual stage
k * P + p of the model. The M microbatches pass through v * P virtual stages, so each rank runs
T = M * v forwards and T backwards, in the order of a schedule table built from groups of G
microbatches (G = microbatch_group_size_per_vp_stage, default P):

    for each group of G microbatches: chunk 0 on the group, chunk 1 on the group, ..., chunk v-1

Example, M = 4, v = 2, G = 2:  (microbatch, chunk) = (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1).
Forward number k runs entry k of the table; backward number k runs entry k with the chunk mirrored
(v - 1 - chunk), since gradients go through the chunks in reverse.

    warm-up    W = min(2 (P - p - 1) + (v - 1) G, T) forwards (W = T when forward_only)
    steady     T - W times: forward W + k and backward k, with one exchange for both
    cool-down  the remaining W backwards

Every rank makes exactly one exchange (a batch of sends and receives) per step, and sends and receives
between two ranks pair up in order, so each rank runs one exchange behind its upstream neighbour;
`_receives_at` works out from this which exchanges carry a tensor for which chunk. Constraints:
P <= G <= M, and the last group (M mod G microbatches) is empty or has at least P of them, otherwise
a rank would wait for an activation its neighbour only produces later.
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


def get_schedule_table(num_microbatches: int, num_model_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward, in order: groups of `group_size` microbatches, each group
    through chunk 0, then chunk 1, ... (the last group holds the remaining microbatches)."""
    table = []
    for group_start in range(0, num_microbatches, group_size):
        group = range(group_start, min(group_start + group_size, num_microbatches))
        table.extend((microbatch, chunk) for chunk in range(num_model_chunks) for microbatch in group)
    return table


def num_warmup_microbatches(
    pipeline_size: int, pipeline_rank: int, num_model_chunks: int, group_size: int, total: int, forward_only: bool
) -> int:
    """Forwards before the first backward on this rank: 2 (P - p - 1) + (v - 1) G, at most T."""
    if forward_only:
        return total
    return min(2 * (pipeline_size - pipeline_rank - 1) + (num_model_chunks - 1) * group_size, total)


def check_interleaving(num_microbatches: int, pipeline_size: int, group_size: int) -> None:
    """Raises ValueError unless P <= G <= M and M mod G is 0 or >= P."""
    if not pipeline_size <= group_size <= num_microbatches:
        raise ValueError(
            f"the interleaved schedule needs pipeline-parallel size ({pipeline_size}) <= microbatch group size "
            f"(--microbatch-group-size-per-virtual-pipeline-stage, {group_size}) <= number of microbatches "
            f"({num_microbatches}); raise the global batch size or lower the group size"
        )
    remainder = num_microbatches % group_size
    if 0 < remainder < pipeline_size:
        raise ValueError(
            f"the interleaved schedule needs the number of microbatches ({num_microbatches}) modulo the microbatch "
            f"group size ({group_size}) to be 0 or at least the pipeline-parallel size ({pipeline_size}), got "
            f"{remainder}"
        )


@timed_schedule
def forward_backward_pipelining_with_interleaving(
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
    """Runs the interleaved schedule over this rank's model chunks (a list, one per virtual stage, with
    one data iterator each); returns the last stage's loss reports (empty elsewhere)."""
    if not isinstance(model, list) or not isinstance(data_iterator, list) or len(model) != len(data_iterator):
        raise ValueError("the interleaved schedule takes a list of model chunks and a list of as many data iterators")
    if collect_non_loss_data:
        raise ValueError("collect_non_loss_data is not supported yet")
    config = get_model_config(model[0])
    if config.overlap_p2p_comm:
        raise ValueError(
            "overlap_p2p_comm is not supported yet: the interleaved schedule exchanges tensors between steps "
            "(set overlap_p2p_comm=False, --no-overlap-p2p-communication)"
        )
    size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_chunks = len(model)
    group_size = config.microbatch_group_size_per_vp_stage or size
    check_interleaving(num_microbatches, size, group_size)
    total = num_microbatches * num_chunks
    num_warmup = num_warmup_microbatches(size, rank, num_chunks, group_size, total, forward_only)
    num_steady = total - num_warmup
    all_warmup = num_warmup == total
    table = get_schedule_table(num_microbatches, num_chunks, group_size)
    is_first_rank, is_last_rank = rank == 0, rank == size - 1
    shape = p2p.pipeline_tensor_shape(config, seq_length, micro_batch_size)

    def chunk_of(step: int, forward: bool) -> int:
        chunk = table[step % total][1]
        return chunk if forward else num_chunks - 1 - chunk

    def is_last_microbatch_of_chunk(step: int) -> bool:
        return table[step][0] == num_microbatches - 1

    def _receives_at(step: int, forward: bool) -> tuple[bool, int]:
        """Whether the exchange after step `step` receives a tensor for this rank, and for which chunk.

        Any rank but the leading one (first in forward, last in backward) receives the input of its own
        next step from its upstream neighbour. The leading rank's tensors come round the ring from the
        trailing rank, P - 1 exchanges behind: at exchange k, the output of the trailing rank's step
        k - (P - 1) on chunk c, which feeds chunk c + 1 (c - 1 in backward) - nothing when c is the final
        chunk of that direction or when the trailing rank has not produced anything yet.
        """
        leading = is_first_rank if forward else is_last_rank
        if not leading:
            return True, chunk_of(step + 1, forward)
        if step < size - 1:
            return False, chunk_of(step + 1, forward)
        trailing_chunk = chunk_of(step - (size - 1), forward)
        final_chunk = num_chunks - 1 if forward else 0
        receives = trailing_chunk != final_chunk
        return receives, trailing_chunk + 1 if forward else trailing_chunk - 1

    grad_sync = GradSyncSwitch(config)
    grad_sync.disable()
    input_tensors = [[] for _ in model]  # per chunk: inputs received and not yet backpropagated
    forwards_run = [0 for _ in model]
    released = [0 for _ in model]  # inputs popped (after backward, or after forward when forward_only)
    output_tensors = [[] for _ in model]
    output_tensor_grads = [[] for _ in model]
    forward_data_store = []
    total_num_tokens = new_token_count()

    def run_forward(step: int):
        chunk = chunk_of(step, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        if chunk == 0 and is_first_rank:
            input_tensors[chunk].append(None)
        last_stage = chunk == num_chunks - 1 and is_last_rank
        # The first rank may hold several received inputs of a chunk ahead of its forwards.
        input_tensor = input_tensors[chunk][forwards_run[chunk] - released[chunk]]
        forwards_run[chunk] += 1
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator[chunk], model[chunk], num_microbatches, input_tensor,
            forward_data_store, config, is_last_stage=last_stage,
        )
        total_num_tokens.add_(num_tokens)
        if forward_only:
            input_tensors[chunk].pop(0)
            released[chunk] += 1
        else:
            output_tensors[chunk].append(output_tensor)
        return None if last_stage else output_tensor

    def run_backward(step: int):
        chunk = chunk_of(step, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        if is_last_microbatch_of_chunk(step):
            grad_sync.enable()  # this chunk's last backward may launch its reduction
        if chunk == num_chunks - 1 and is_last_rank:
            output_tensor_grads[chunk].append(None)
        released[chunk] += 1
        input_tensor_grad = backward_step(
            input_tensors[chunk].pop(0), output_tensors[chunk].pop(0), output_tensor_grads[chunk].pop(0), config
        )
        grad_sync.disable()
        return None if chunk == 0 and is_first_rank else input_tensor_grad

    with torch.set_grad_enabled(not forward_only):
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        if not is_first_rank:
            input_tensors[0].append(p2p.recv_forward(shape, config))

        for step in range(num_warmup):
            output_tensor = run_forward(step)
            recv_prev, next_chunk = _receives_at(step, forward=True)
            if step == total - 1:
                recv_prev = False
            if step == num_warmup - 1 and not forward_only and not all_warmup:
                input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
                    output_tensor, None, recv_prev, not is_last_rank, shape, config
                )
                if not is_last_rank:
                    output_tensor_grads[num_chunks - 1].append(output_tensor_grad)
            else:
                input_tensor = p2p.send_forward_recv_forward(output_tensor, recv_prev, shape, config)
            if recv_prev:
                input_tensors[next_chunk].append(input_tensor)
            deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

        for step in range(num_steady):
            forward_k = step + num_warmup
            output_tensor = run_forward(forward_k)
            input_tensor_grad = run_backward(step)
            recv_prev, next_forward_chunk = _receives_at(forward_k, forward=True)
            recv_next, next_backward_chunk = _receives_at(step, forward=False)
            if step == num_steady - 1:
                recv_prev = False
            input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
                output_tensor, input_tensor_grad, recv_prev, recv_next, shape, config
            )
            deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
            if recv_prev:
                input_tensors[next_forward_chunk].append(input_tensor)
            if recv_next:
                output_tensor_grads[next_backward_chunk].append(output_tensor_grad)

        if not forward_only:
            if all_warmup and not is_last_rank:
                output_tensor_grads[num_chunks - 1].append(p2p.recv_backward(shape, config))
            for step in range(num_steady, total):
                input_tensor_grad = run_backward(step)
                recv_next, next_chunk = _receives_at(step, forward=False)
                if step == total - 1:
                    recv_next = False
                output_tensor_grad = p2p.send_backward_recv_backward(input_tensor_grad, recv_next, shape, config)
                if recv_next:
                    output_tensor_grads[next_chunk].append(output_tensor_grad)

    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    grad_sync.enable()
    if not forward_only:
        finalize_gradients(config, model, total_num_tokens)
    return forward_data_store
