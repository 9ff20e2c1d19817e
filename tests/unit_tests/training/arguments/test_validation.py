"""validate_args: Megatron's derived values (hand-computed here) and one error that lists every problem."""

import signal

import pytest
import torch

from .conftest import MINIMAL


def flags_without(*names):
    """MINIMAL minus the given flags (and their values)."""
    result, skip = [], False
    for token in MINIMAL:
        if skip:
            skip = False
        elif token in names:
            skip = True
        else:
            result.append(token)
    return result


def test_data_parallel_size_and_default_global_batch(validated, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = validated(*MINIMAL)
    assert (args.world_size, args.data_parallel_size) == (8, 8)  # 8 / (TP 1 x PP 1 x CP 1)
    assert args.global_batch_size == 16  # micro batch 2 x DP 8, one microbatch
    assert "setting global batch size to 16" in capsys.readouterr().out


@pytest.mark.parametrize("hidden, heads, expected_ffn", [
    (768, 12, 2048),    # 8 x 768 / 3 = 2048 exactly
    (1024, 16, 2688),   # 2730.7 / 64 = 42.7 -> 42 x 64
    (4096, 32, 10880),  # 10922.7 / 64 = 170.7 -> 170 x 64
])
def test_swiglu_ffn_rule(validated, hidden, heads, expected_ffn):
    args = validated(*flags_without("--hidden-size", "--num-attention-heads"), "--hidden-size", str(hidden),
                     "--num-attention-heads", str(heads), "--swiglu")
    assert args.ffn_hidden_size == expected_ffn
    assert args.kv_channels == hidden // heads


def test_other_derived_values(validated, capsys):
    args = validated(*flags_without("--seq-length", "--num-layers"), "--encoder-seq-length", "32",
                     "--encoder-num-layers", "2", "--num-query-groups", "2")
    assert "--num-query-groups 2 is ignored without --group-query-attention" in capsys.readouterr().err
    assert (args.seq_length, args.encoder_seq_length) == (32, 32)
    assert (args.num_layers, args.encoder_num_layers) == (2, 2)
    assert args.ffn_hidden_size == 256 and args.kv_channels == 16
    assert args.params_dtype == torch.float32
    assert args.dataloader_type == "single"
    assert (args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples) == (0, 0, 0)
    assert args.expert_tensor_parallel_size == 1 and args.virtual_pipeline_model_parallel_size is None
    assert args.start_weight_decay == args.end_weight_decay == 0.01
    assert args.exit_signal is signal.SIGTERM
    assert args.add_qkv_bias is True  # kept in sync with add_bias_linear, as in Megatron
    assert not hasattr(args, "recompute_activations") and not hasattr(args, "checkpoint_activations")


def test_precision_derivations(validated, capsys):
    args = validated(*MINIMAL, "--bf16")
    assert args.params_dtype == torch.bfloat16 and args.accumulate_allreduce_grads_in_fp32 is True
    args = validated(*MINIMAL, "--bf16", "--grad-reduce-in-bf16")
    assert args.accumulate_allreduce_grads_in_fp32 is False
    args = validated(*MINIMAL, "--fp16", "--loss-scale", "4096")
    assert args.params_dtype == torch.float16 and args.check_for_nan_in_loss_and_grad is True


def test_split_default_and_warning(validated, capsys):
    args = validated(*MINIMAL, "--data-path", "my-gpt2_text_document")
    assert args.split == "969, 30, 1"
    assert 'Using legacy default value of "969, 30, 1"' in capsys.readouterr().err
    args = validated(*MINIMAL, "--mock-data")
    assert args.split is None


def test_sequence_parallel_is_turned_off_at_tp_1(validated, capsys):
    args = validated(*MINIMAL, "--sequence-parallel")
    assert args.sequence_parallel is False
    assert "disabling --sequence-parallel" in capsys.readouterr().err


def test_recompute_activations_means_selective(validated):
    args = validated(*MINIMAL, "--recompute-activations")
    assert args.recompute_granularity == "selective" and args.recompute_method is None


def test_script_defaults_fill_only_unset_flags(validated):
    args = validated(*MINIMAL, "--vocab-file", "mine.json",
                     defaults={"vocab_file": "theirs.json", "tokenizer_type": "GPT2BPETokenizer"})
    assert args.vocab_file == "mine.json" and args.tokenizer_type == "GPT2BPETokenizer"


def test_two_problems_are_reported_in_one_error(problems):
    message = problems(*MINIMAL, "--fp16", "--bf16", "--max-position-embeddings", "16")
    assert message.startswith("2 problem(s) with the arguments:")
    assert "--fp16 and --bf16 are mutually exclusive" in message
    assert "--max-position-embeddings 16 must be >= --seq-length 32" in message


def test_global_batch_arithmetic_in_the_message(problems, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = problems(*flags_without("--micro-batch-size"), "--tensor-model-parallel-size", "2",
                       "--micro-batch-size", "4", "--global-batch-size", "10")
    assert ("global batch size 10 is not a multiple of micro batch size 4 x data parallel size 1 "
            "(= world size 2 / (TP 2 x PP 1 x CP 1)); nearest valid: 8 or 12") in message


def test_heads_and_world_divisibility_list_legal_sizes(problems, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    message = problems(*flags_without("--hidden-size", "--num-attention-heads"), "--hidden-size", "768",
                       "--num-attention-heads", "12", "--tensor-model-parallel-size", "8")
    assert ("--num-attention-heads 12 must be divisible by --tensor-model-parallel-size 8; "
            "valid TP sizes: 1, 2, 3, 4, 6, 12") in message
    monkeypatch.setenv("WORLD_SIZE", "6")
    message = problems(*MINIMAL, "--tensor-model-parallel-size", "4")
    assert "world size 6 is not divisible by TP 4 x PP 1 x CP 1 = 4; TP x PP x CP must be one of 1, 2, 3, 6" in message


@pytest.mark.parametrize("extra, removed, expected", [
    ([], ["--num-layers"], "--num-layers is required"),
    ([], ["--micro-batch-size"], "--micro-batch-size is required"),
    ([], ["--seq-length"], "--seq-length is required"),
    ([], ["--lr"], "--lr is required for training"),
    ([], ["--train-iters"], "give --train-iters or --train-samples (or --skip-train)"),
    (["--train-samples", "100"], [], "give --train-iters or --train-samples, not both"),
    (["--lr-decay-samples", "100"], [], "--lr-decay-samples does not go with --train-iters; use --lr-decay-iters"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], [],
     "give --lr-warmup-fraction or --lr-warmup-iters, not both"),
    (["--rampup-batch-size", "2", "2", "100"], [], "--rampup-batch-size needs sample-based training"),
    (["--min-lr", "0.1"], [], "--min-lr 0.1 must be <= --lr 0.001"),
    (["--hidden-size", "66"], ["--hidden-size"], "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (["--swiglu", "--hidden-size", "16"], ["--hidden-size"],
     "default --ffn-hidden-size int(8 x 16 / 3 / 64) x 64 is 0"),
    (["--swiglu", "--squared-relu"], [], "choose one activation: --swiglu and --squared-relu"),
    (["--group-query-attention", "--num-query-groups", "3"], [],
     "--num-query-groups 3 must divide --num-attention-heads 4"),
    (["--seq-length", "32", "--encoder-seq-length", "16"], ["--seq-length"],
     "give --seq-length or --encoder-seq-length, not both (got 32 and 16)"),
    (["--recompute-granularity", "full"], [],
     "--recompute-granularity full needs --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"], [],
     "--recompute-num-layers 3 must be between 1 and the 2 layers per pipeline stage"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], [],
     "--recompute-method applies to --recompute-granularity full only"),
    (["--fp16-lm-cross-entropy"], [], "--fp16-lm-cross-entropy needs --fp16"),
    (["--fp32-residual-connection"], [], "--fp32-residual-connection needs --fp16 or --bf16"),
    (["--save", "ckpt"], [], "--save needs --save-interval"),
    (["--save-interval", "10", "--save-retain-interval", "15"], [],
     "--save-retain-interval 15 must be a multiple of --save-interval 10"),
    (["--mock-data", "--data-path", "a"], [], "choose one data source: --mock-data and --data-path"),
    (["--train-data-path", "a", "--per-split-data-args-path", "s.json"], [],
     "give --train-data-path or --per-split-data-args-path, not both"),
    (["--data-path", "a", "--split", "90,x,1"], [], "--split '90,x,1' must be up to three comma-separated numbers"),
    (["--weight-decay-incr-style", "linear"], [], "needs --start-weight-decay and --end-weight-decay"),
    (["--lr-decay-style", "WSD"], [], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--global-batch-size", "3"], [], "nearest valid: 2 or 4"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], ["--num-layers"],
     "--num-layers 3 over --pipeline-model-parallel-size 2: num_layers (3) must be divisible by "
     "pipeline_model_parallel_size (2); valid sizes: 1, 3"),
])
def test_each_problem_message(problems, extra, removed, expected):
    assert expected in problems(*flags_without(*removed), *extra)


def test_rampup_arithmetic(problems, validated):
    samples = [*flags_without("--train-iters"), "--train-samples", "1000", "--global-batch-size", "16"]
    args = validated(*samples, "--rampup-batch-size", "4", "4", "500")
    assert args.rampup_batch_size == [4, 4, 500]
    message = problems(*samples, "--rampup-batch-size", "4", "5", "500")
    assert "--global-batch-size 16 - start 4 = 12 must be a non-negative multiple of the increment 5" in message
    assert "--rampup-batch-size increment 5 is not a multiple of micro batch size 2" in message


def test_unrecognized_flag_suggests_the_closest(capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(args_list=[*MINIMAL, "--hiden-size", "3"])
    assert "--hiden-size: did you mean --hidden-size?" in capsys.readouterr().err


def test_validating_twice_gives_the_same_arguments(validated):
    from megatron.training.arguments import validate_args

    args = validated(*MINIMAL, "--checkpoint-activations", "--swiglu")
    once = dict(vars(args))
    assert vars(validate_args(args)) == once


def test_tensor_parallel_divisibility_lists_legal_tp_sizes(problems, validated, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = validated(*MINIMAL, "--tensor-model-parallel-size", "4", "--sequence-parallel",
                     "--group-query-attention", "--num-query-groups", "2")  # 2 TP ranks share each key/value head
    assert (args.tensor_model_parallel_size, args.num_query_groups, args.sequence_parallel) == (4, 2, True)
    monkeypatch.setenv("WORLD_SIZE", "6")
    message = problems(*flags_without("--hidden-size", "--num-attention-heads"), "--hidden-size", "96",
                       "--num-attention-heads", "12", "--group-query-attention", "--num-query-groups", "4",
                       "--ffn-hidden-size", "100", "--tensor-model-parallel-size", "6")
    assert ("--num-query-groups 4 must be a multiple or a divisor of --tensor-model-parallel-size 6; "
            "valid TP sizes: 1, 2, 4, 12") in message
    assert ("--ffn-hidden-size 100 must be divisible by --tensor-model-parallel-size 6; valid TP sizes (dividing "
            "it and the heads): 1, 2, 4") in message
