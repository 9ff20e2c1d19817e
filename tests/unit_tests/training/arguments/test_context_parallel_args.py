"""--context-parallel-size and --cp-comm-type: accepted where context-parallel attention works, refused
with the flag and the valid values elsewhere."""

import pytest

from megatron.training.arguments import core_transformer_config_from_args

from .conftest import MINIMAL

CP2 = ["--context-parallel-size", "2"]


@pytest.mark.parametrize("comm_type, expected", [("p2p", "p2p"), ("allgather", "allgather"),
                                                 ("all_gather", "all_gather")])
def test_context_parallel_is_accepted(validated, monkeypatch, comm_type, expected):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = validated(*MINIMAL, *CP2, "--cp-comm-type", comm_type)
    assert (args.context_parallel_size, args.data_parallel_size) == (2, 2)  # 4 / (TP 1 x PP 1 x CP 2)
    config = core_transformer_config_from_args(args)
    assert (config.context_parallel_size, config.cp_comm_type) == (2, expected)


def test_one_comm_type_per_layer_reaches_the_config(validated, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = validated(*MINIMAL, *CP2, "--cp-comm-type", "p2p", "allgather")
    assert core_transformer_config_from_args(args).cp_comm_type == ["p2p", "allgather"]


@pytest.mark.parametrize("flags, expected", [
    (["--seq-length", "30", "--max-position-embeddings", "30"],
     "--seq-length 30 must be divisible by 2 x --context-parallel-size 2 = 4"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "36",
      "--max-position-embeddings", "36"],
     "--seq-length 36 must be divisible by --tensor-model-parallel-size 2 x 2 x --context-parallel-size 2 = 8 "
     "with --sequence-parallel"),
    (["--cp-comm-type", "a2a"], "--cp-comm-type a2a is not supported yet; use p2p (ring) or allgather"),
    (["--cp-comm-type", "ring"], "--cp-comm-type ring is not one of p2p, allgather, a2a, a2a+p2p"),
    (["--cp-comm-type", "p2p", "p2p", "p2p"], "--cp-comm-type lists 3 types; give one for all layers or one per "
                                              "layer (2)"),
    (["--reset-attention-mask"], "--reset-attention-mask with --context-parallel-size 2 is not supported yet"),
    (["--hierarchical-context-parallel-sizes", "2"], "--hierarchical-context-parallel-sizes [2]: is for "
                                                     "--cp-comm-type a2a+p2p, which is not supported yet"),
])
def test_refused_with_the_rule(problems, monkeypatch, flags, expected):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert expected in problems(*MINIMAL, *CP2, *flags)
