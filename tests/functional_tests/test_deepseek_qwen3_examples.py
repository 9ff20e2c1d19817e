"""examples/deepseek_v3/train_deepseek_v3_16b.sh and examples/qwen3/train_qwen3_30b_a3b.sh: the recipes as
parsed for their GPU layouts (shapes, routing, parameter counts), and tiny runs of both under torchrun on
one CPU rank for 2 iterations (DeepSeek's line carrying mtp_1 loss and seq_load_balancing_loss beside lm
loss)."""

import math
import os
import re

import pytest

from megatron.training.arguments import validate_args
from megatron.training.memory_estimate import total_parameters

from .harness import ROOT
from .test_examples import SCRIPT_DEFAULTS, _captured_launch, _parsed, _run

DEEPSEEK = "examples/deepseek_v3/train_deepseek_v3_16b.sh"
QWEN3 = "examples/qwen3/train_qwen3_30b_a3b.sh"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--lr-warmup-iters", "0", "--vocab-size", "512", "--make-vocab-size-divisible-by", "128",
        "--num-workers", "0", "--eval-iters", "1", "--save-interval", "2", "--expert-model-parallel-size", "1"]
TINY_DEEPSEEK = TINY + [
    "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
    "--yarn-original-max-position-embeddings", "16", "--num-experts", "8", "--moe-layer-freq", "[0]+[1]",
    "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "64", "--moe-router-topk", "4",
    "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
]
TINY_QWEN3 = TINY + ["--num-query-groups", "2", "--kv-channels", "24", "--num-experts", "4",
                     "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]


def _recipe(script, tmp_path, monkeypatch, world_size):
    _, arguments = _captured_launch(script, ["ckpt", "tb", "MOCK", "MOCK"], tmp_path, GPUS_PER_NODE="8",
                                    NUM_NODES=str(world_size // 8))
    args = validate_args(_parsed(arguments, monkeypatch, world_size=world_size), SCRIPT_DEFAULTS)
    args.padded_vocab_size = args.vocab_size  # both vocabularies are multiples of the padding
    return args


def test_deepseek_v3_script_is_the_16b_recipe_on_8_gpus(tmp_path, monkeypatch):
    args = _recipe(DEEPSEEK, tmp_path, monkeypatch, 8)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size) == (27, 2048, 16, 129280)
    assert args.multi_latent_attention and args.q_lora_rank is None and args.qk_layernorm
    assert (args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (512, 128, 64, 128)
    assert (args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == (40, 1.0, 1.0)
    assert args.moe_layer_freq == [0] + [1] * 26 and (args.num_experts, args.moe_router_topk) == (64, 8)
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert args.moe_router_enable_expert_bias and args.moe_router_score_function == "sigmoid"
    assert (args.mtp_num_layers, args.mtp_loss_scaling_factor) == (1, 0.1)
    assert (args.expert_model_parallel_size, args.data_parallel_size) == (8, 8) and args.use_distributed_optimizer
    assert round(total_parameters(args) / 1e9, 1) == 16.4


def test_qwen3_script_is_qwen3_30b_a3b_on_16_gpus(tmp_path, monkeypatch):
    args = _recipe(QWEN3, tmp_path, monkeypatch, 16)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups) == (48, 2048, 32, 4)
    assert (args.kv_channels, args.rotary_base, args.vocab_size) == (128, 1000000, 151936) and args.qk_layernorm
    assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_router_topk, args.moe_layer_freq) == (128, 768, 8, 1)
    assert not args.moe_router_pre_softmax and args.moe_shared_expert_intermediate_size is None
    assert args.expert_model_parallel_size == 16
    assert round(total_parameters(args) / 1e9, 2) == 30.53  # Qwen's 30.5B


@pytest.mark.parametrize("script, flags, side_losses", [
    (DEEPSEEK, TINY_DEEPSEEK, ["mtp_1 loss", "seq_load_balancing_loss"]),
    (QWEN3, TINY_QWEN3, ["load_balancing_loss"]),
])
def test_script_trains_two_iterations_on_one_cpu_rank(tmp_path, script, flags, side_losses):
    output = _run(["bash", os.path.join(ROOT, script), "ckpt", "tb", "MOCK", "MOCK", *flags], cwd=tmp_path)
    for name in ["lm loss", *side_losses]:
        values = [float(value) for value in re.findall(rf"\| {name}: ([0-9.E+-]+) \|", output)]
        assert len(values) == 2 and all(math.isfinite(value) for value in values), (name, output[-3000:])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
