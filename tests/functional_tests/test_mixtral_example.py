"""examples/mixtral/train_mixtral_8x7b.sh: Megatron-LM's Mixtral recipe as parsed, and a tiny run of it
under torchrun on 2 CPU ranks with expert parallelism 2 (router losses logged, one checkpoint file per
expert rank)."""

import os
import re

from megatron.training.arguments import validate_args

from .harness import ROOT, read_scalars
from .test_examples import SCRIPT_DEFAULTS, _captured_launch, _parsed, _run

SCRIPT = "examples/mixtral/train_mixtral_8x7b.sh"
TINY_MIXTRAL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr-warmup-iters", "0",
    "--lr-decay-iters", "2", "--vocab-size", "512", "--num-workers", "0", "--eval-iters", "1",
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


def test_mixtral_script_trains_with_expert_parallelism_on_two_cpu_ranks(tmp_path):
    output = _run(["bash", os.path.join(ROOT, SCRIPT), "ckpt", "tb", "MOCK", "MOCK", *TINY_MIXTRAL], cwd=tmp_path,
                  GPUS_PER_NODE="2")
    assert re.search(r"iteration\s+2/\s+2 \|", output), output[-4000:]
    for name in ("lm loss", "load_balancing_loss", "z_loss"):
        values = [float(v) for v in re.findall(rf"\| {name}: ([0-9.E+-]+) \|", output)]
        assert len(values) == 2, (name, output[-3000:])
        assert sorted(read_scalars(str(tmp_path / "tb"), name)) == [1, 2]
    # One file per expert rank: mp_rank_{tp:02d}_{ep:03d}, each with its own two experts per layer.
    for ep_rank in (0, 1):
        assert (tmp_path / "ckpt" / "iter_0000002" / f"mp_rank_00_{ep_rank:03d}" / "model_optim_rng.pt").exists()
