"""Pipeline p2p transfers on gloo: values arrive from the right neighbour in both directions, also with two
stages, where next and prev are the same rank and one batch carries an activation and a gradient each way."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, MICRO_BATCH, HIDDEN = 4, 2, 8


def _config(**overrides):
    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=1, pipeline_model_parallel_size=2,
                             pipeline_dtype=torch.float32, **overrides)


def _exchange(rank, world_size):
    """Rank r sends the activation 10 + r to next and the gradient 20 + r to prev, in one batch."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    config = _config()
    shape = p2p.pipeline_tensor_shape(config, SEQ, MICRO_BATCH)
    activation, gradient = p2p.send_forward_backward_recv_forward_backward(
        torch.full(shape, 10.0 + rank), torch.full(shape, 20.0 + rank), True, True, shape, config
    )
    problems = []
    for wrong in (torch.zeros(SEQ + 1, MICRO_BATCH, HIDDEN), torch.zeros(shape, dtype=torch.float16)):
        with pytest.raises(ValueError) as error:
            p2p.send_forward_recv_forward(wrong, False, shape, config)
        problems.append(str(error.value))
    with pytest.raises(ValueError) as error:
        p2p.pipeline_tensor_shape(_config(variable_seq_lengths=True), SEQ, MICRO_BATCH)
    problems.append(str(error.value))
    parallel_state.destroy_model_parallel()
    return dict(shape=tuple(activation.shape), activation=activation.unique().tolist(),
                gradient=gradient.unique().tolist(), requires_grad=activation.requires_grad, problems=problems)


def test_both_directions_between_two_stages(pipeline_ranks):
    results = [per_rank["p2p"] for per_rank in pipeline_ranks(2)]
    assert [(result["activation"], result["gradient"]) for result in results] == [([11.0], [21.0]), ([10.0], [20.0])]
    assert all(result["shape"] == (SEQ, MICRO_BATCH, HIDDEN) and result["requires_grad"] for result in results)
    wrong_shape, wrong_dtype, variable = results[0]["problems"]
    assert "pipeline stage output has shape (5, 2, 8) and dtype torch.float32, but the stages exchange (4, 2, 8)" in (
        wrong_shape)
    assert "dtype torch.float16" in wrong_dtype
    assert "variable_seq_lengths=True is not supported yet" in variable
