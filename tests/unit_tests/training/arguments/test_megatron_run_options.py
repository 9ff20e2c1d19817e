"""Megatron-LM's rules for --deterministic-mode, the evaluation batch sizes and the overlap options that
change only its speed (each refusal as Megatron-LM refuses the command line)."""

import pytest

from megatron.training.determinism import environment_problems

from .conftest import MINIMAL

_INTERLEAVED = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                "1", "--global-batch-size", "8"]


@pytest.mark.parametrize("flags, expected", [
    (["--deterministic-mode", "--cross-entropy-loss-fusion"],
     "--deterministic-mode cannot be combined with --cross-entropy-loss-fusion (not bit-exact)"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
     "Transformer Engine's cross entropy (--cross-entropy-fusion-impl te) is disabled in Megatron-LM"),
    (["--eval-micro-batch-size", "3"], "--eval-global-batch-size 4 is not a multiple of --eval-micro-batch-size 3 x "
                                       "data parallel size 2"),
    (["--num-distributed-optimizer-instances", "2"], "--num-distributed-optimizer-instances 2 needs "
                                                     "--use-distributed-optimizer"),
    (["--num-distributed-optimizer-instances", "4", "--use-distributed-optimizer"],
     "--num-distributed-optimizer-instances 4 must divide the data-parallel size 2"),
    (["--overlap-param-gather-with-optimizer-step"], "--overlap-param-gather-with-optimizer-step needs "
                                                     "--use-distributed-optimizer and --overlap-param-gather and "
                                                     "virtual pipeline stages"),
    (["--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"],
     "--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1"),
    (["--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"],
     "--defer-embedding-wgrad-compute cannot go with --no-gradient-accumulation-fusion"),
    (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1"),
    (["--window-size", "(4, 0)", "--context-parallel-size", "2"],
     "--window-size with --context-parallel-size 2 is not supported yet"),
    (["--window-size", "4,0,1"], "--window-size (4, 0, 1) must be two numbers (left, right)"),
    (["--overlap-p2p-communication-warmup-flush"], "--overlap-p2p-communication-warmup-flush needs virtual pipeline "
                                                   "stages"),
])
def test_refused_as_megatron_refuses(problems, monkeypatch, flags, expected):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert expected in problems(*MINIMAL, "--global-batch-size", "4", *flags)


def test_evaluation_batches_default_to_the_training_ones(validated, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = validated(*MINIMAL, "--global-batch-size", "8")
    assert (args.eval_micro_batch_size, args.eval_global_batch_size) == (2, 8)
    args = validated(*MINIMAL, "--global-batch-size", "8", "--eval-micro-batch-size", "1", "--eval-global-batch-size",
                     "6")
    assert (args.eval_micro_batch_size, args.eval_global_batch_size) == (1, 6)


def test_deterministic_environment_values():
    assert environment_problems({"NCCL_ALGO": "Ring,^NVLS", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == []
    assert environment_problems({"NCCL_ALGO": "Tree", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1",
                                 "MAMBA_DETERMINISTIC": "0"}) == [
        "--deterministic-mode: NCCL_ALGO='Tree' is not deterministic; each algorithm must be one of Ring, "
        "CollnetDirect, CollnetChain, ^NVLS (or leave it unset: Ring)",
        "--deterministic-mode: NVTE_ALLOW_NONDETERMINISTIC_ALGO='1' is not deterministic; use 0 (or leave it unset)",
        "--deterministic-mode: MAMBA_DETERMINISTIC='0' turns determinism off; unset it or set 1"]


def test_deterministic_mode_refuses_a_nondeterministic_launcher_setting(problems, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    assert "--deterministic-mode: NCCL_ALGO='Tree' is not deterministic" in problems(*MINIMAL, "--deterministic-mode")
