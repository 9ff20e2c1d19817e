"""A checkpoint in Megatron-LM's own torch format, built here from reference 8.1/8.2/8.4 (key names, shapes,
`checkpoint_version` 3.0, an args Namespace with Megatron's fields), read by the inspector, resharded by
convert.py, and resumed by `pretrain_gpt.py --load` (finite, falling loss); an expert-parallel checkpoint of
pretrain_gpt.py converted to EP=1 and to Hugging Face Mixtral."""

import argparse
import math
import os

import pytest
import torch

from megatron.training.checkpointing.conversion.convert import main as convert
from megatron.training.checkpointing.conversion.inspect_checkpoint import describe_checkpoint

from .harness import read_scalars, run
from .test_tensor_parallel_training import LLAMA, NO_DROPOUT, TINY, TOLERANCE, pretrain_gpt

LAYERS, HIDDEN, HEADS, FFN, SEQ, PADDED_VOCAB, ITERATION = 2, 64, 4, 256, 64, 512, 10
TRAINING = [
    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "4",
    "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]


def megatron_args() -> argparse.Namespace:
    """The fields Megatron-LM's `arguments.py` records for this model (a subset of its ~600)."""
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, kv_channels=16,
        group_query_attention=False, num_query_groups=1, seq_length=SEQ, max_position_embeddings=SEQ,
        position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False,
        add_bias_linear=True, add_qkv_bias=False, untie_embeddings_and_output_weights=False,
        bias_gelu_fusion=True, openai_gelu=False, make_vocab_size_divisible_by=128, padded_vocab_size=PADDED_VOCAB,
        tokenizer_type="NullTokenizer", vocab_size=500, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, transformer_impl="local",
        params_dtype=torch.float32, micro_batch_size=4, global_batch_size=8, iteration=ITERATION,
        consumed_train_samples=ITERATION * 8, skipped_train_samples=0, consumed_valid_samples=0,
        ckpt_format="torch", use_distributed_optimizer=False,
    )


def megatron_model_state() -> dict:
    """The Megatron-Core local-spec keys and shapes of reference 8.4 (tied embeddings: no output_layer)."""
    torch.manual_seed(0)
    shapes = {"embedding.word_embeddings.weight": (PADDED_VOCAB, HIDDEN),
              "embedding.position_embeddings.weight": (SEQ, HIDDEN),
              "decoder.final_layernorm.weight": (HIDDEN,), "decoder.final_layernorm.bias": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"decoder.layers.{i}."
        shapes.update({
            layer + "input_layernorm.weight": (HIDDEN,), layer + "input_layernorm.bias": (HIDDEN,),
            layer + "self_attention.linear_qkv.weight": (3 * HIDDEN, HIDDEN),
            layer + "self_attention.linear_qkv.bias": (3 * HIDDEN,),
            layer + "self_attention.linear_proj.weight": (HIDDEN, HIDDEN),
            layer + "self_attention.linear_proj.bias": (HIDDEN,),
            layer + "pre_mlp_layernorm.weight": (HIDDEN,), layer + "pre_mlp_layernorm.bias": (HIDDEN,),
            layer + "mlp.linear_fc1.weight": (FFN, HIDDEN), layer + "mlp.linear_fc1.bias": (FFN,),
            layer + "mlp.linear_fc2.weight": (HIDDEN, FFN), layer + "mlp.linear_fc2.bias": (HIDDEN,),
        })
    return {name: (torch.ones(shape) if "layernorm.weight" in name else 0.02 * torch.randn(shape))
            for name, shape in shapes.items()}


def write_megatron_checkpoint(directory: str) -> None:
    """<dir>/iter_0000010/mp_rank_00/model_optim_rng.pt and the tracker, as Megatron-LM writes them."""
    path = os.path.join(directory, f"iter_{ITERATION:07d}", "mp_rank_00")
    os.makedirs(path)
    torch.save({"args": megatron_args(), "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": megatron_model_state(), "num_floating_point_operations_so_far": 1.0e12},
               os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write(str(ITERATION))


def test_inspector_reads_a_megatron_checkpoint(tmp_path):
    write_megatron_checkpoint(str(tmp_path / "megatron"))
    report = describe_checkpoint(str(tmp_path / "megatron"))
    assert "iteration: 10" in report and "checkpoint_version: 3.0" in report
    assert "parallel layout: 1 file(s): mp_rank_00" in report and "padded_vocab_size = 512" in report
    assert "absent: optimizer, opt_param_scheduler, rng_state" in report
    assert any(line.split()[:3] == ["decoder.layers.1.mlp.linear_fc1.weight", "(256,", "64)"]
               for line in report.splitlines())
    convert(["--model-type", "GPT", "--load-dir", str(tmp_path / "megatron"), "--save-dir", str(tmp_path / "tp2"),
             "--target-tensor-parallel-size", "2"])
    assert "parallel layout: 2 file(s): mp_rank_00, mp_rank_01" in describe_checkpoint(str(tmp_path / "tp2"))


def test_pretrain_gpt_continues_training_from_a_megatron_checkpoint(tmp_path):
    write_megatron_checkpoint(str(tmp_path / "megatron"))
    tensorboard = str(tmp_path / "tb")
    result = run("pretrain_gpt.py", [*TRAINING, "--load", str(tmp_path / "megatron"), "--no-load-optim",
                                     "--no-load-rng", "--train-iters", "30", "--tensorboard-dir", tensorboard])
    assert "successfully loaded checkpoint" in result.stdout + result.stderr
    losses = read_scalars(tensorboard, "lm loss")
    assert min(losses) == ITERATION + 1 and max(losses) == 30  # resumed after iteration 10
    values = [losses[step] for step in sorted(losses)]
    assert all(math.isfinite(value) for value in values)
    assert sum(values[-5:]) / 5 < sum(values[:5]) / 5 - 0.5, values


def test_expert_parallel_checkpoint_of_pretrain_gpt_converts_to_ep1_and_mixtral(tmp_path):
    """A Mixtral-shaped run at EP=2 on 2 processes saves torch-format files mp_rank_00_000/_001 at iteration
    2; convert.py merges the experts to EP=1, and a one-process run resumed from that checkpoint computes
    the EP=2 run's loss of iteration 3 (the weights after iteration 2; within 2e-5 relative, as any change
    of layout); the same checkpoint exports as a MixtralForCausalLM that `transformers` loads."""
    transformers = pytest.importorskip("transformers")
    mixtral = TINY + NO_DROPOUT + LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--train-iters", "3",
                                           "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]
    pretrain_gpt(2, mixtral + ["--expert-model-parallel-size", "2", "--save", str(tmp_path / "ep2"),
                               "--ckpt-format", "torch",
                               "--save-interval", "2", "--tensorboard-dir", str(tmp_path / "ep2_tb")])
    assert sorted(os.listdir(tmp_path / "ep2" / "iter_0000002")) == ["mp_rank_00_000", "mp_rank_00_001"]
    convert(["--model-type", "GPT", "--load-dir", str(tmp_path / "ep2"), "--save-dir", str(tmp_path / "ep1"),
             "--ckpt-step", "2", "--target-expert-parallel-size", "1"])
    pretrain_gpt(1, mixtral + ["--load", str(tmp_path / "ep1"), "--no-load-optim", "--no-load-rng",
                               "--tensorboard-dir", str(tmp_path / "ep1_tb")])
    expected, resumed = read_scalars(str(tmp_path / "ep2_tb"), "lm loss"), read_scalars(str(tmp_path / "ep1_tb"),
                                                                                         "lm loss")
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(expected[3], rel=TOLERANCE)

    convert(["--model-type", "GPT", "--saver", "hf", "--load-dir", str(tmp_path / "ep2"), "--save-dir",
             str(tmp_path / "hf"), "--ckpt-step", "2"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_local_experts == 4
