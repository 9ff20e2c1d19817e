"""The arguments stored in a checkpoint: one error listing every mismatch, and --use-checkpoint-args."""

import argparse

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.checkpointing import (
    check_checkpoint_args,
    load_args_from_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests.unit_tests.training.checkpointing.tiny_run import (
    BATCH_SIZE,
    VOCAB_SIZE,
    assert_same,
    build_run,
    make_args,
    model_state,
)

pytestmark = pytest.mark.usefixtures("single_rank")


def _run_args(**values):
    defaults = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                    make_vocab_size_divisible_by=128, padded_vocab_size=128, tokenizer_type="GPT2BPETokenizer",
                    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, vocab_file=None)
    return argparse.Namespace(**{**defaults, **values})


def test_every_mismatch_is_listed_in_one_error():
    saved = _run_args(num_layers=4, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=1,
                      pipeline_model_parallel_size=2)
    with pytest.raises(ValueError) as error:
        check_checkpoint_args(saved, _run_args(tensor_model_parallel_size=2, load="ckpt"),
                              checkpoint_name="ckpt/iter_0000010")
    lines = str(error.value).splitlines()
    assert lines[0] == "ckpt/iter_0000010 does not match this run's arguments:"
    assert lines[1:] == [
        "  - num_layers: checkpoint 4, this run 2",
        "  - hidden_size: checkpoint 64, this run 32",
        "  - tensor_model_parallel_size: checkpoint 1, this run 2 (TP)",
        "  - pipeline_model_parallel_size: checkpoint 2, this run 1 (PP)",
        "  - a torch-format checkpoint is tied to its parallel layout; reshard it with: python "
        "tools/checkpoint/convert.py --model-type GPT --loader core --saver core --load-dir ckpt --save-dir "
        "ckpt-tp2-pp1 --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1, then --load ckpt-tp2-pp1 "
        "(convert.py copies the weights only: add --no-load-optim --no-load-rng)",
    ]


def test_vocabulary_and_positions_are_compared_with_a_vocab_file_only():
    saved = _run_args(max_position_embeddings=32, padded_vocab_size=256, tokenizer_type="HuggingFaceTokenizer")
    check_checkpoint_args(saved, _run_args())
    with pytest.raises(ValueError) as error:
        check_checkpoint_args(saved, _run_args(vocab_file="vocab.json"))
    message = str(error.value)
    for expected in ("max_position_embeddings: checkpoint 32, this run 16",
                     "padded_vocab_size: checkpoint 256, this run 128",
                     "tokenizer_type: checkpoint HuggingFaceTokenizer, this run GPT2BPETokenizer"):
        assert expected in message


def test_unrecorded_arguments_and_old_versions():
    check_checkpoint_args(argparse.Namespace(num_layers=2), _run_args())
    # Before version 3.0 the TP size was `model_parallel_size` and the PP size was not recorded.
    old = argparse.Namespace(model_parallel_size=2, pipeline_model_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_model_parallel_size: checkpoint 2, this run 1") as error:
        check_checkpoint_args(old, _run_args(), checkpoint_version=2.0)
    assert "pipeline" not in str(error.value)


def test_load_checkpoint_checks_the_arguments_before_touching_the_model(tmp_path):
    args = make_args("--save", tmp_path)
    model, optimizer, scheduler = build_run(args, seed=1)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
    other_args = make_args("--load", tmp_path, "--num-layers", 3, "--hidden-size", 48)
    before = model_state(model)
    with pytest.raises(ValueError) as error:
        load_checkpoint([model], optimizer, scheduler, args=other_args)
    message = str(error.value)
    assert "iter_0000001/mp_rank_00/model_optim_rng.pt does not match" in message
    assert "num_layers: checkpoint 2, this run 3" in message and "hidden_size: checkpoint 32, this run 48" in message
    assert_same(model_state(model), before)


def test_use_checkpoint_args_takes_the_model_shape_from_the_checkpoint(tmp_path):
    args = make_args("--save", tmp_path, "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear")
    model, optimizer, scheduler = build_run(args, seed=1)
    save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)

    # The command line names no model shape; a flag it does give (--seq-length) is kept.
    args = parse_args(args_list=[
        "--use-checkpoint-args", "--load", str(tmp_path), "--seq-length", "8", "--micro-batch-size", str(BATCH_SIZE),
        "--train-iters", "10", "--lr", "1e-2", "--use-checkpoint-opt-param-scheduler", "--ckpt-format", "torch",
    ])
    args, checkpoint_args = load_args_from_checkpoint(args)
    assert checkpoint_args.num_layers == 2
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (2, 32, 4, 64)
    assert (args.max_position_embeddings, args.seq_length, args.padded_vocab_size) == (16, 8, VOCAB_SIZE)
    assert args.swiglu and args.normalization == "RMSNorm" and not args.add_bias_linear
    assert args.tensor_model_parallel_size == 1

    args = validate_args(args)
    args.padded_vocab_size = VOCAB_SIZE
    fresh_model, fresh_optimizer, fresh_scheduler = build_run(args, seed=2)
    load_checkpoint([fresh_model], fresh_optimizer, fresh_scheduler, args=args)
    assert_same(model_state(fresh_model), model_state(model))


def test_use_checkpoint_args_without_a_checkpoint_keeps_the_command_line(tmp_path):
    args = parse_args(args_list=["--use-checkpoint-args", "--load", str(tmp_path), "--num-layers", "3"])
    assert load_args_from_checkpoint(args) == (args, None)
    assert args.num_layers == 3 and args.hidden_size is None
    args.load = None
    assert load_args_from_checkpoint(args) == (args, None)


def test_renamed_arguments_of_older_checkpoints_read_under_todays_names(tmp_path):
    """Megatron-LM before its rename (and this project before it) saved norm_epsilon / apply_layernorm_1p;
    readers see layernorm_epsilon / layernorm_zero_centered_gamma."""
    import torch

    from megatron.training.checkpointing import load_checkpoint_file

    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": argparse.Namespace(norm_epsilon=1e-6, apply_layernorm_1p=True)}, path)
    args = load_checkpoint_file(path)["args"]
    assert (args.layernorm_epsilon, args.layernorm_zero_centered_gamma) == (1e-6, True)
