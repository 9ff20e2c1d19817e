"""The start-up banner's parameter total (each weight counted once under any TP x PP x DP x EP layout, tied
embeddings included), its kernel lines and its memory estimate."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training.arguments import parse_args, validate_args
from megatron.training.banner import _counted_here, banner_lines
from megatron.training.memory_estimate import estimate_memory, format_bytes, total_parameters
from megatron.training.parallel_layout import ParallelLayout
from tests.unit_tests.dist_checkpointing.tiny_gpt import build
from tests.unit_tests.dist_utils import run_distributed

FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 25 --lr 1e-3 --tokenizer-type NullTokenizer "
         "--vocab-size 128 --mock-data --bf16").split()
# (TP, PP, EP) on 4 ranks; EP 0: the dense model. Tied embeddings: PP > 1 keeps a copy on the last stage.
LAYOUTS = [(1, 1, 0), (2, 2, 0), (1, 1, 1), (2, 1, 2)]


def test_banner_states_parameters_kernels_and_the_estimated_memory(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    args = validate_args(parse_args(args_list=FLAGS))
    args.padded_vocab_size = 128
    ranks = [{"rank": 0, "host": "node", "tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0, "parameters": 1234}]
    estimate = estimate_memory(args, 2)
    text = "\n".join(banner_lines(args, ranks, num_microbatches=2, parameters=1234))
    assert "layout: world size 1 = TP 1 x PP 1 x CP 1 x DP 1 (EP 1)" in text
    assert "model: 1,234 parameters; 64 tokens per iteration (4 sequences of 16)" in text
    assert ("kernels: --transformer-impl transformer_engine (this framework's PyTorch layers), --attention-backend "
            "auto") in text and "  attention: " in text
    assert (f"memory per GPU (estimate, first pipeline stage): {format_bytes(estimate.total)} = weights "
            f"{format_bytes(estimate.weights)} + gradients {format_bytes(estimate.gradients)}") in text
    # Without a built model, the arguments' count.
    assert f"model: {total_parameters(args):,} parameters" in "\n".join(banner_lines(args, ranks, 2))


def _parameters_counted_per_layout(rank, world_size):
    counted = {}
    for tensor_parallel, pipeline_parallel, expert_parallel in LAYOUTS:
        ddp, _ = build(tensor_parallel, pipeline_parallel, False, seed=1, expert_parallel=expert_parallel)
        if (tensor_parallel, pipeline_parallel) == (1, 1) and expert_parallel <= 1:  # the whole model on each rank
            counted[("whole", expert_parallel)] = sum(param.numel() for param in ddp.module.parameters())
        layout = ParallelLayout.from_parallel_state()
        mine = torch.tensor([sum(param.numel() for param in ddp.module.parameters() if _counted_here(param, layout))])
        dist.all_reduce(mine)
        counted[(tensor_parallel, pipeline_parallel, expert_parallel)] = mine.item()
    parallel_state.destroy_model_parallel()
    return counted


def test_every_parameter_is_counted_once_under_tp_pp_dp_and_ep():
    counted = run_distributed(_parameters_counted_per_layout, 4)[0]
    for tensor_parallel, pipeline_parallel, expert_parallel in LAYOUTS:
        whole = counted[("whole", min(expert_parallel, 1))]
        assert counted[(tensor_parallel, pipeline_parallel, expert_parallel)] == whole, (
            tensor_parallel, pipeline_parallel, expert_parallel)
