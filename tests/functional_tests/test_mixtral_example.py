"""examples/mixtral/train_mixtral_8x7b.sh: Megatron-LM's Mixtral recipe as parsed, and tiny runs of it
under torchrun on 2 CPU ranks with expert parallelism 2 and the distributed optimizer (router losses
logged, exact resume through a torch_dist checkpoint)."""

import os
import re

from megatron.training.arguments import validate_args

from .harness import ROOT, read_scalars
from .test_examples import SCRIPT_DEFAULTS, _captured_launch, _parsed, _run

SCRIPT = "examples/mixtral/train_mixtral_8x7b.sh"
TINY_MIXTRAL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "0",
    "--lr-decay-iters", "4", "--vocab-size", "512", "--num-workers", "0", "--eval-iters", "1",
    "--save-interval", "2", "--num-experts", "4", "--pipeline-model-parallel-size", "1",
    "--expert-model-parallel-size", "2", "--moe-z-loss-coeff", "1e-3",
]


def test_mixtral_script_is_megatrons_recipe_on_32_gpus(tmp_path, monkeypatch):
    _, arguments = _captured_launch(SCRIPT, ["ckpt", "tb", "MOCK", "MOCK"], tmp_path, GPUS_PER_NODE="8",
                                    NUM_NODES="4")
    args = validate_args(_parsed(arguments, monkeypatch, world_size=32), SCRIPT_DEFAULTS)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_query_groups) == (32, 4096, 14336, 8)
    assert (args.num_experts, args.moe_router_topk, args.moe_aux_loss_coeff) == (8, 2, 1e-2)
    assert args.moe_grouped_gemm and args.moe_token_dispatcher_type == "alltoall"
    assert (args.pipeline_model_parallel_size, args.expert_model_parallel_size, args.data_parallel_size) == (4, 8, 8)
    assert (args.global_batch_size, args.lr, args.min_lr, args.lr_warmup_iters) == (256, 1e-4, 1e-5, 500)
    assert args.swiglu and args.normalization == "RMSNorm" and not args.add_bias_linear and args.bf16
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.ckpt_format == "torch_dist"


def _losses(output: str, name: str) -> dict:
    return {int(step): float(value) for step, value in
            re.findall(rf"iteration\s+(\d+)/\s+4 \|.*?\| {name}: ([0-9.E+-]+) \|", output)}


def test_mixtral_script_trains_and_resumes_exactly_with_expert_parallelism_on_two_cpu_ranks(tmp_path):
    """EP = 2 with the distributed optimizer under torchrun: router losses on the console line and in
    TensorBoard, and 2 + 2 iterations through a torch_dist checkpoint equal 4 straight ones."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    command = ["bash", os.path.join(ROOT, SCRIPT), "ckpt", "tb", "MOCK", "MOCK", *TINY_MIXTRAL]
    output = _run(command, cwd=straight, GPUS_PER_NODE="2")
    for name in ("lm loss", "load_balancing_loss", "z_loss"):
        assert sorted(_losses(output, name)) == [1, 2, 3, 4], (name, output[-3000:])
        assert sorted(read_scalars(str(straight / "tb"), name)) == [1, 2, 3, 4]
    # Megatron's recipe: distributed optimizer under EP, sharded torch_dist checkpoints.
    assert (straight / "ckpt" / "iter_0000004" / "metadata.json").exists()

    first = _run(command + ["--exit-interval", "2"], cwd=split, GPUS_PER_NODE="2")
    second = _run(command, cwd=split, GPUS_PER_NODE="2")
    resumed = {**_losses(first, "lm loss"), **_losses(second, "lm loss")}
    assert sorted(_losses(second, "lm loss")) == [3, 4]
    assert resumed == _losses(output, "lm loss")
