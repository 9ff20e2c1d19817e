"""Rank layout of parallel_state against the groups Megatron-LM's `RankGenerator` computes."""

import pytest

from megatron.core import parallel_state
from megatron.core.parallel_state import RankGenerator

from .dist_utils import run_distributed


def test_rank_generator_matches_reference_16_ranks():
    # 16 ranks, TP2 CP2 DP2 PP2, order tp-cp-ep-dp-pp: the table computed with Megatron's generator.
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("tp")[:2] == [[0, 1], [2, 3]] and gen.get_ranks("tp")[-1] == [14, 15]
    assert gen.get_ranks("cp")[:5] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10]]
    assert gen.get_ranks("dp")[:5] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12]]
    assert gen.get_ranks("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert gen.get_ranks("pp")[:2] == [[0, 8], [1, 9]] and gen.get_ranks("pp")[-1] == [7, 15]
    assert gen.get_ranks("tp-pp")[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert gen.get_ranks("tp-cp")[0] == [0, 1, 2, 3]


def test_rank_generator_tp_pp_dp_order():
    # --use-tp-pp-dp-mapping puts pp before dp: DP peers become the slowest coordinate.
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert gen.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_generator_rejects_bad_order():
    with pytest.raises(ValueError, match="exactly once"):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-dp-pp")


def _layout(rank, world_size, tp, pp, cp, ep):
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    ps = parallel_state
    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
        "edp": ps.get_expert_data_parallel_world_size(),
        "first": ps.is_pipeline_first_stage(),
        "last": ps.is_pipeline_last_stage(),
        "embedding": ps.is_rank_in_embedding_group(),
        "src": ps.get_tensor_model_parallel_src_rank(),
        "next": ps.get_pipeline_model_parallel_next_rank(),
    }


def test_initialize_model_parallel_eight_ranks():
    # TP2 x PP2 x DP2 (EP2 over the DP ranks): rank = tp + 2*(dp + 2*pp).
    layouts = run_distributed(_layout, 8, 2, 2, 1, 2)
    for rank, got in enumerate(layouts):
        tp_rank, dp_rank, pp_rank = rank % 2, (rank // 2) % 2, rank // 4
        assert got["tp"] == (tp_rank, 2)
        assert got["dp"] == (dp_rank, 2) and got["dp_cp"] == 2
        assert got["pp"] == (pp_rank, 2)
        assert got["cp"] == (0, 1)
        assert got["ep"] == (dp_rank, 2) and got["edp"] == 1
        assert got["first"] == (pp_rank == 0) and got["last"] == (pp_rank == 1)
        assert got["embedding"]  # first and last stage both hold (tied) embeddings
        assert got["src"] == rank - tp_rank
        assert got["next"] == (rank + 4) % 8


def _bad_layout(rank, world_size):
    with pytest.raises(ValueError, match=r"world size \(2\) is not divisible by tensor \(4\)"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=4)
    return True


def test_initialize_model_parallel_reports_arithmetic():
    assert run_distributed(_bad_layout, 2) == [True, True]


def test_single_process_defaults_without_initialisation():
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_tensor_model_parallel_rank() == 0
    assert not parallel_state.model_parallel_is_initialized()
