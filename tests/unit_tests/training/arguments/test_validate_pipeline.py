"""Validation of the pipeline flags: virtual stages, uneven stages, the interleaved schedule's groups."""

import pytest

from .conftest import MINIMAL

# 8 layers on 4 ranks (PP 2 x DP 2), micro batch 2 (a later flag overrides an earlier one).
BASE = [*MINIMAL, "--num-layers", "8", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(autouse=True)
def four_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")


def test_virtual_stages_from_layers_per_virtual_stage(validated, capsys):
    # 8 layers / PP 2 = 4 per rank, 2 per virtual stage -> 2 virtual stages; G defaults to PP; 4 microbatches.
    args = validated(*BASE, "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "16")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.microbatch_group_size_per_vp_stage == 2
    assert args.overlap_p2p_comm is False  # Megatron's default overlap is not built: a warning says so
    assert "not overlapped with compute yet" in capsys.readouterr().err


def test_no_virtual_stages(validated):
    args = validated(*BASE, "--num-virtual-stages-per-pipeline-rank", "1")
    assert args.virtual_pipeline_model_parallel_size is None and args.overlap_p2p_comm is False


def test_uneven_first_stage_leaves_the_rest_to_the_other_stages(validated):
    assert validated(*BASE, "--decoder-first-pipeline-num-layers", "3").virtual_pipeline_model_parallel_size is None


def test_layout_sets_the_virtual_stages(validated):
    # 4 stages over PP 2: 2 virtual stages per rank; the first holds the embedding only.
    args = validated(*BASE, "--pipeline-model-parallel-layout", "E|t*4|t*3|tL", "--global-batch-size", "8")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert validated(*BASE, "--pipeline-model-parallel-layout", "Et*3|t*5L").virtual_pipeline_model_parallel_size is None


def test_group_rule_waits_for_the_step_with_a_batch_size_schedule(problems, validated):
    # Megatron-LM's schedule checks PP <= G <= M each step; with a schedule M is only known then.
    assert "microbatch-group-size" in problems(*BASE, "--num-virtual-stages-per-pipeline-rank", "2")
    validated(*BASE, "--num-virtual-stages-per-pipeline-rank", "2", "--step-batch-size-schedule", "0:16")


def test_uneven_stages_with_virtual_stages(validated):
    # 2 layers on the first rank, 6 on the last; 2 virtual stages: chunks of 1 and 3 layers.
    args = validated(*BASE, "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "6",
                     "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8")
    assert args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("extra, expected", [
    (["--num-layers-per-virtual-pipeline-stage", "3"],
     "4 layers per pipeline stage (= 8 / PP 2) are not divisible by --num-layers-per-virtual-pipeline-stage 3"),
    (["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"],
     "first (3) + last (3) stage layers must equal num_layers (8)"),
    (["--decoder-first-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "give the virtual stages as --num-virtual-stages-per-pipeline-rank"),
    (["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "5",
      "--num-virtual-stages-per-pipeline-rank", "2"],
     "pipeline rank 0 holds 3 layers, not divisible by virtual_pipeline_model_parallel_size (2)"),
    (["--decoder-first-pipeline-num-layers", "0"], "--decoder-first-pipeline-num-layers 0 must be positive"),
    # 1 microbatch per DP rank by default (global batch 4 = micro batch 2 x DP 2): G = 3 > M.
    (["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "3"],
     "--pipeline-model-parallel-size 2 <= --microbatch-group-size-per-virtual-pipeline-stage 3 <= 1 microbatches "
     "(= global batch 4 / (micro batch 2 x DP 2))"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "4",
      "--global-batch-size", "20"],
     "5 microbatches (= global batch 20 / (micro batch 2 x DP 2)) modulo "
     "--microbatch-group-size-per-virtual-pipeline-stage 4 to be 0 or at least --pipeline-model-parallel-size 2, "
     "got 1"),
    (["--pipeline-model-parallel-layout", "E|tt|tt|L"],
     "pipeline layout 'E|tt|tt|L' holds 4 transformer layer(s) t, but --num-layers is 8"),
    (["--pipeline-model-parallel-layout", "Et*4|t*4|L"],
     "--pipeline-model-parallel-layout Et*4|t*4|L has 3 stage(s), not a multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-layout", "E|t*8|L|", "--account-for-loss-in-pipeline-split"],
     "a pipeline layout cannot be combined"),
])
def test_pipeline_problems(problems, extra, expected):
    assert expected in problems(*BASE, *extra)


def test_virtual_stages_need_pipeline_parallelism(problems, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    message = problems(*BASE, "--pipeline-model-parallel-size", "1", "--num-virtual-stages-per-pipeline-rank", "2")
    assert "virtual pipeline stages" in message and "need --pipeline-model-parallel-size > 1" in message
