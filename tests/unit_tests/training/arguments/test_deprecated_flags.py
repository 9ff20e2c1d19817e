"""Removed Megatron flags from old tutorials: translated with one deprecation line each, or refused with
the replacement named. Expected meanings come from the flags' history in Megatron-LM's arguments.py."""

import pytest

from .conftest import MINIMAL


def deprecation_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "is deprecated" in line]


@pytest.mark.parametrize("flags, expected", [
    # 2019-21: --checkpoint-activations alone was full, uniform, one layer per chunk.
    (["--checkpoint-activations"], ("full", "uniform", 1)),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2"], ("full", "uniform", 2)),
    # 2021-22: the method flag implied full recompute; num-layers defaulted to 1.
    (["--activations-checkpoint-method", "block"], ("full", "block", 1)),
    (["--checkpoint-activations", "--activations-checkpoint-method", "block",
      "--activations-checkpoint-num-layers", "2"], ("full", "block", 2)),
    # The new flags may be mixed in when they agree.
    (["--checkpoint-activations", "--recompute-method", "block", "--recompute-num-layers", "2"],
     ("full", "block", 2)),
])
def test_old_recompute_flags(validated, capsys, flags, expected):
    args = validated(*MINIMAL, *flags)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == expected
    old_flags = [flag for flag in flags if flag.startswith("--") and not flag.startswith("--recompute")]
    lines = deprecation_lines(capsys.readouterr().err)
    assert len(lines) == len(old_flags)  # exactly one line per deprecated flag
    for flag in old_flags:
        assert sum(line.startswith(f"WARNING: {flag} is deprecated") for line in lines) == 1
    assert not hasattr(args, "checkpoint_activations") and not hasattr(args, "activations_checkpoint_method")


def translate(flags):
    """parse_args + the deprecated-flag step of validation: (args, problems)."""
    from megatron.training.arguments import parse_args
    from megatron.training.arguments.deprecated import translate_deprecated_args

    args = parse_args(args_list=[*MINIMAL, *flags])
    problems = []
    translate_deprecated_args(args, problems)
    return args, problems


@pytest.mark.parametrize("flags, dest, value", [
    (["--use-flash-attn"], "attention_backend", "flash"),
    (["--use-rotary-position-embeddings"], "position_embedding_type", "rope"),
    (["--no-position-embedding"], "position_embedding_type", "none"),
    (["--use-rotary-position-embeddings", "--no-position-embedding"], "position_embedding_type", "rope"),
    (["--layernorm-epsilon", "1e-6"], "layernorm_epsilon", 1e-6),
    (["--override-lr-scheduler"], "override_opt_param_scheduler", True),
    (["--use-checkpoint-lr-scheduler"], "use_checkpoint_opt_param_scheduler", True),
    (["--distribute-checkpointed-activations"], "distribute_saved_activations", True),
])
def test_renamed_flags(capsys, flags, dest, value):
    args, problems = translate(flags)
    assert problems == []
    assert getattr(args, dest) == value
    old_flags = [flag for flag in flags if flag.startswith("--")]
    assert len(deprecation_lines(capsys.readouterr().err)) == len(old_flags)


@pytest.mark.parametrize("flags, old_dest", [
    (["--data-impl", "mmap"], "data_impl"),
    (["--dataset-impl", "infer"], "data_impl"),
    (["--use-mcore-models"], "deprecated_use_mcore_models"),
    (["--DDP-impl", "torch"], "DDP_impl"),
    (["--no-contiguous-buffers-in-local-ddp"], "no_contiguous_buffers_in_local_ddp"),
    (["--no-async-tensor-model-parallel-allreduce"], "no_async_tensor_model_parallel_allreduce"),
    (["--no-query-key-layer-scaling"], "no_query_key_layer_scaling"),
    (["--log-batch-size-to-tensorboard"], "log_batch_size_to_tensorboard"),
    (["--dist-ckpt-format", "zarr"], "dist_ckpt_format"),
])
def test_ignored_flags(capsys, flags, old_dest):
    args, problems = translate(flags)
    assert problems == [] and not hasattr(args, old_dest)
    lines = deprecation_lines(capsys.readouterr().err)
    assert len(lines) == 1 and flags[0] in lines[0] and "is deprecated; ignored: " in lines[0]


def test_deprecation_lines_only_on_rank_zero(validated, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = validated(*MINIMAL, "--checkpoint-activations")
    assert args.recompute_granularity == "full"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flags, expected", [
    (["--batch-size", "8"], "--batch-size was removed from Megatron-LM: use --micro-batch-size"),
    (["--model-parallel-size", "2"], "--model-parallel-size was removed from Megatron-LM: use "
                                     "--tensor-model-parallel-size"),
    (["--warmup", "0.01"], "--warmup was removed from Megatron-LM: use --lr-warmup-fraction"),
    (["--use-legacy-models"], "legacy (non-core) models do not exist here"),
    (["--train-data", "corpus.json"], "pass --train-data-path"),
    (["--data-impl", "lazy"], "--data-impl/--dataset-impl lazy selects the pre-mmap index format"),
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     "--checkpoint-activations means --recompute-granularity full, but --recompute-granularity selective"),
    (["--activations-checkpoint-method", "block", "--recompute-method", "uniform"],
     "--activations-checkpoint-method means --recompute-method block, but --recompute-method uniform"),
])
def test_refused_flags_name_the_replacement(problems, flags, expected):
    assert expected in problems(*MINIMAL, *flags)


def test_old_fp8_flags_select_the_format(validated):
    assert validated(*MINIMAL, "--bf16", "--fp8-hybrid").fp8 == "hybrid"
    assert validated(*MINIMAL, "--bf16", "--fp8-e4m3").fp8 == "e4m3"


def test_use_dist_ckpt_selects_torch_dist(validated):
    assert validated(*MINIMAL, "--use-dist-ckpt").ckpt_format == "torch_dist"
