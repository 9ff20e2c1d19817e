"""The pretrain_gpt.py command lines of widely read Megatron-LM tutorials (the CodeParrot tutorial on the
Hugging Face blog, the Megatron-Core developer guide) parse as written, with the values
Megatron derives from them (worked out by hand below)."""

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[4]

# CodeParrot tutorial (GPT-2 small on Python code), verbatim.
CODEPARROT = """
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 12 --hidden-size 768
--num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4
--global-batch-size 16 --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
--data-path codeparrot_text_document --vocab-file vocab.json --merge-file merges.txt --save checkpoints
--save-interval 1000 --log-interval 100 --eval-interval 1000 --eval-iters 10
--activations-checkpoint-method uniform
""".split()

# Flags shown in the Megatron-Core developer guide (one command line, on 16 ranks so TP 4 x PP 4 fits).
DEVELOPER_GUIDE = """
--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --num-layers 32 --hidden-size 4096
--num-attention-heads 32 --micro-batch-size 2 --global-batch-size 1024 --seq-length 4096
--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
--expert-model-parallel-size 8 --num-experts 64 --moe-router-topk 2
""".split()


def test_codeparrot_command_line(validated, capsys):
    # pretrain_gpt.py passes args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}.
    args = validated(*CODEPARROT, defaults={"tokenizer_type": "GPT2BPETokenizer"})
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert (args.vocab_file, args.merge_file) == ("vocab.json", "merges.txt")
    assert args.data_path == ["codeparrot_text_document"]
    assert args.split == "969, 30, 1"  # Megatron's legacy default when --split is missing
    assert (args.world_size, args.data_parallel_size) == (1, 1)
    assert args.global_batch_size == 16
    assert args.ffn_hidden_size == 4 * 768 and args.kv_channels == 768 // 12
    assert args.params_dtype == torch.float16
    assert args.check_for_nan_in_loss_and_grad is False  # fp16 with dynamic loss scaling
    # --activations-checkpoint-method uniform == full recompute, uniform, 1 layer per chunk.
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 1)
    assert args.lr_warmup_fraction == 0.01 and args.lr_decay_iters == 320000
    assert (args.save, args.save_interval, args.eval_interval, args.eval_iters) == ("checkpoints", 1000, 1000, 10)
    assert args.ckpt_format == "torch_dist"
    captured = capsys.readouterr()
    assert "16 = micro batch size 4 x 4 microbatches x data parallel size 1" in captured.out
    deprecations = [line for line in captured.err.splitlines() if "deprecated" in line]
    assert deprecations == ["WARNING: --activations-checkpoint-method is deprecated; using --recompute-granularity "
                            "full --recompute-method uniform --recompute-num-layers 1"]
    assert "--split" in captured.err


def test_developer_guide_flags_parse_and_every_unbuilt_feature_is_named(problems, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    message = problems(*DEVELOPER_GUIDE, "--max-position-embeddings", "4096", "--train-iters", "10", "--lr", "1e-4")
    for flag in ("--tp-comm-overlap", "--fp8-format hybrid"):
        assert f"{flag}:" in message, flag
    assert "not supported yet" in message
    # Megatron's own dependency rules are reported in the same error.
    assert "--tp-comm-overlap needs --sequence-parallel" in message
    assert "--overlap-param-gather needs --use-distributed-optimizer" in message


@pytest.mark.parametrize("world_size, microbatches", [(1, 64), (8, 8)])
def test_overview_config_file(validated, capsys, monkeypatch, world_size, microbatches):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = validated("--config-file", str(REPO / "examples/gpt3/config.yaml"))
    # GPT-3 Small: 12 x 768, 12 heads, 2048 context, 0.5M-token batches of 256 sequences.
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (12, 768, 12)
    assert (args.seq_length, args.max_position_embeddings) == (2048, 2048)
    assert (args.micro_batch_size, args.global_batch_size, args.data_parallel_size) == (4, 256, world_size)
    assert (args.lr, args.min_lr, args.adam_beta2, args.weight_decay) == (6.0e-4, 6.0e-5, 0.95, 0.1)
    assert args.mock_data and args.params_dtype == torch.bfloat16
    assert f"256 = micro batch size 4 x {microbatches} microbatches" in capsys.readouterr().out
