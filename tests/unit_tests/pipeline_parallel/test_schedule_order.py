"""The order of forward (F) and backward (B) steps each stage runs, against orders written out by hand.

A toy stage (one Linear on [s, b, h]) logs "F<microbatch>" when it runs forward and, through an identity
autograd function on its output, "B<microbatch>" when that output's backward runs; with virtual stages
the chunk is appended ("F1.0" = microbatch 1 on chunk 0). Every output sent to the next stage must have
been freed by then (`deallocate_pipeline_outputs`). The expected orders follow reference 9.4:

1F1B, stage p of P: min(P - p - 1, M) warm-up forwards, then one forward + one backward, then the rest.
Interleaved, P = 2, v = 2, M = 4, G = 2: schedule table (microbatch, chunk) = (0,0) (1,0) (0,1) (1,1)
(2,0) (3,0) (2,1) (3,1); backward k runs entry k with the chunk mirrored; warm-up 2 (P - p - 1) + G.
"""

import functools

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.interleaved import get_schedule_table
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, MICRO_BATCH, HIDDEN = 4, 2, 8


class _Logged(torch.autograd.Function):
    """Identity whose backward appends `entry` to `log`."""

    @staticmethod
    def forward(ctx, tensor, log, entry):
        ctx.log, ctx.entry = log, entry
        return tensor.view_as(tensor).clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.entry)
        return grad, None, None


class _ToyStage(MegatronModule):
    def __init__(self, config, pre_process: bool, post_process: bool, vp_stage):
        super().__init__(config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor

    def forward(self, data):
        hidden = data if self.pre_process else self.input_tensor
        return torch.tanh(self.linear(hidden))  # [s, b, h]


def _forward_step(log, outputs, num_chunks, data_iterator, model):
    microbatch, data = next(data_iterator)
    suffix = f".{model.vp_stage}" if num_chunks > 1 else ""
    log.append(f"F{microbatch}{suffix}")
    output = _Logged.apply(model(data), log, f"B{microbatch}{suffix}")
    if not model.post_process:
        outputs.append(output)

    def loss_func(output_tensor):
        loss = output_tensor.float().sum()
        return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach().view(1)}

    return output, loss_func


# (world size, microbatches, model chunks): run by the folder's conftest in the spawn of that world size.
ORDER_CASES = [(4, 5, 1), (2, 4, 2)]


def _record_order(rank, world_size, num_microbatches, num_chunks):
    vpp = num_chunks if num_chunks > 1 else None
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=vpp
    )
    config = TransformerConfig(
        num_layers=world_size * num_chunks, hidden_size=HIDDEN, num_attention_heads=1,
        pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32, deallocate_pipeline_outputs=True,
    )
    model = [
        _ToyStage(
            config,
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
            chunk,
        )
        for chunk in range(num_chunks)
    ]
    torch.manual_seed(0)
    data = [(index, torch.randn(SEQ, MICRO_BATCH, HIDDEN)) for index in range(num_microbatches)]
    log, sent_outputs = [], []
    reports = get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, log, sent_outputs, num_chunks),
        data_iterator=[iter(data) for _ in model] if num_chunks > 1 else iter(data),
        model=model if num_chunks > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
    )
    parallel_state.destroy_model_parallel()
    # Every output sent downstream was freed after sending (reduced to one element; backward still ran).
    assert [output.numel() for output in sent_outputs] == [1] * len(sent_outputs)
    return log, len(reports)


def _orders(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def test_one_f_one_b_orders(pipeline_ranks):
    logs = [per_rank["orders"][(4, 5, 1)] for per_rank in pipeline_ranks(4)]
    expected = _orders(
        """
        F0 F1 F2 F3 B0 F4 B1 B2 B3 B4
        F0 F1 F2 B0 F3 B1 F4 B2 B3 B4
        F0 F1 B0 F2 B1 F3 B2 F4 B3 B4
        F0 B0 F1 B1 F2 B2 F3 B3 F4 B4
        """
    )
    assert [log for log, _ in logs] == expected
    assert [reports for _, reports in logs] == [0, 0, 0, 5]  # loss reports on the last stage only


def test_interleaved_orders_and_schedule_table(pipeline_ranks):
    # Megatron's example: M = 5, v = 2, G = 3 (the last group holds the 2 remaining microbatches).
    assert get_schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0),
                                           (3, 1), (4, 1)]
    logs = [per_rank["orders"][(2, 4, 2)] for per_rank in pipeline_ranks(2)]
    expected = _orders(
        """
        F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0
        F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0
        """
    )
    assert [log for log, _ in logs] == expected
    assert [reports for _, reports in logs] == [0, 4]
