"""Point-to-point transfers between neighbouring pipeline stages (Megatron-Core's `p2p_communication`).

Activations flow forward (stage p -> p + 1) and their gradients backward (p + 1 -> p). Every transfer
has the fixed shape

    [s / CP (/ TP with sequence parallelism), micro batch, h]   in config.pipeline_dtype

so no shapes are exchanged (variable sequence lengths are not supported yet). "next" and "prev" are
the neighbours on the pipeline ring: the last stage's next is the first stage, which the interleaved
schedule uses to pass chunk v's output of the last rank to chunk v + 1 on the first rank.

Each call posts all of its sends and receives as one `batch_isend_irecv` and waits for them, in one
fixed order on every rank: forward-flowing (send next, receive prev) before backward-flowing (send
prev, receive next). Sends and receives between the same two ranks are matched in the order they are
posted, so this order pairs them correctly even with two stages, where next and prev are the same rank.
"""

import weakref

import torch
import torch.distributed as dist

from megatron.core import parallel_state

# Weak: a destroyed group is forgotten, and this set does not keep its worker threads alive.
_READY_GROUPS = weakref.WeakSet()


def pipeline_tensor_shape(config, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
    """[s, b, h] of the activations passed between stages, split like the activations themselves."""
    if config.variable_seq_lengths:
        raise ValueError("variable_seq_lengths=True is not supported yet with pipeline parallelism: the stages "
                         "exchange activations of the fixed shape [seq_length, micro_batch_size, hidden_size]")
    seq = seq_length // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq, micro_batch_size, config.hidden_size)


def _make_group_ready(group) -> None:
    """With NCCL, the first operation on a group must involve all of its ranks (batch_isend_irecv's
    documented rule); a one-element all-reduce on first use satisfies it. Every stage communicates
    before it waits on a neighbour, so all ranks reach this call."""
    if group in _READY_GROUPS:
        return
    dist.all_reduce(torch.zeros(1, device=parallel_state.collective_device()), group=group)
    _READY_GROUPS.add(group)


def _communicate(
    *,
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape,
    config,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sends to / receives from the neighbours; returns (tensor from prev, tensor from next).

    Received tensors require grad: an activation received from prev is the input of this stage's
    autograd graph, whose gradient goes back with the backward pass.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    _make_group_ready(group)
    device = parallel_state.collective_device()
    dtype = config.pipeline_dtype
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    tensor_recv_prev = torch.empty(tensor_shape, dtype=dtype, device=device) if recv_prev else None
    tensor_recv_next = torch.empty(tensor_shape, dtype=dtype, device=device) if recv_next else None

    operations = []
    if tensor_send_next is not None:
        operations.append(dist.P2POp(dist.isend, _sendable(tensor_send_next, tensor_shape, dtype), next_rank, group))
    if tensor_recv_prev is not None:
        operations.append(dist.P2POp(dist.irecv, tensor_recv_prev, prev_rank, group))
    if tensor_send_prev is not None:
        operations.append(dist.P2POp(dist.isend, _sendable(tensor_send_prev, tensor_shape, dtype), prev_rank, group))
    if tensor_recv_next is not None:
        operations.append(dist.P2POp(dist.irecv, tensor_recv_next, next_rank, group))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    if tensor_recv_prev is not None:
        tensor_recv_prev.requires_grad_()
    if tensor_recv_next is not None:
        tensor_recv_next.requires_grad_()
    return tensor_recv_prev, tensor_recv_next


def _sendable(tensor: torch.Tensor, tensor_shape, dtype) -> torch.Tensor:
    """The tensor's data, contiguous, after checking it has the shape and dtype the peer will receive."""
    if tuple(tensor.shape) != tuple(tensor_shape) or tensor.dtype != dtype:
        raise ValueError(
            f"pipeline stage output has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, but the stages "
            f"exchange {tuple(tensor_shape)} in {dtype} ([seq / CP (/ TP with sequence parallelism), micro batch, "
            "hidden] in config.pipeline_dtype); variable sequence lengths are not supported yet"
        )
    return tensor.detach().contiguous()


def recv_forward(tensor_shape, config) -> torch.Tensor | None:
    """The activation from the previous stage (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    received, _ = _communicate(
        tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )
    return received


def recv_backward(tensor_shape, config) -> torch.Tensor | None:
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    _, received = _communicate(
        tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
        tensor_shape=tensor_shape, config=config,
    )
    return received


def send_forward(output_tensor, tensor_shape, config) -> None:
    """Sends this stage's output to the next stage (nothing on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )


def send_backward(input_tensor_grad, tensor_shape, config) -> None:
    """Sends the gradient of this stage's input to the previous stage (nothing on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    _communicate(
        tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )


def send_forward_recv_backward(output_tensor, tensor_shape, config) -> torch.Tensor | None:
    """Sends the output forward and receives its gradient back (1F1B steady state)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    _, received = _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=True,
        tensor_shape=tensor_shape, config=config,
    )
    return received


def send_backward_recv_forward(input_tensor_grad, tensor_shape, config) -> torch.Tensor | None:
    """Sends an input gradient back and receives the next activation (1F1B steady state)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    received, _ = _communicate(
        tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )
    return received


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape, config) -> torch.Tensor | None:
    """Interleaved schedule: send an output to the next rank, maybe receive an activation from prev."""
    received, _ = _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev, recv_next=False,
        tensor_shape=tensor_shape, config=config,
    )
    return received


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape, config) -> torch.Tensor | None:
    """Interleaved schedule: send an input gradient to the prev rank, maybe receive one from next."""
    _, received = _communicate(
        tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=recv_next,
        tensor_shape=tensor_shape, config=config,
    )
    return received


def send_forward_backward_recv_forward_backward(
    output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape, config
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Interleaved steady state: both sends and both receives in one batch; returns (input, output grad)."""
    return _communicate(
        tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
        recv_next=recv_next, tensor_shape=tensor_shape, config=config,
    )
