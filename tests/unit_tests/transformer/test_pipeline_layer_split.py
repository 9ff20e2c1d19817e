"""Layers per (virtual) pipeline stage and their global offsets, against splits worked out by hand
(reference 9.3 and the layer tables of Megatron-Core's transformer_block.py)."""

import pytest
import torch

from megatron.core.transformer.pipeline_layer_split import (
    get_num_layers_to_build,
    get_transformer_layer_offset,
    pipeline_layer_counts,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(num_layers, pp, vpp=None, **split):
    return TransformerConfig(
        num_layers=num_layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, **split,
    )


def _layers(config):
    """{(virtual stage, rank): [global layer indices]}."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    return {
        (v, p): list(range(get_transformer_layer_offset(config, v, p),
                           get_transformer_layer_offset(config, v, p) + get_num_layers_to_build(config, v, p)))
        for v in range(vpp) for p in range(config.pipeline_model_parallel_size)
    }


def test_even_split():
    assert _layers(_config(8, 4)) == {(0, 0): [0, 1], (0, 1): [2, 3], (0, 2): [4, 5], (0, 3): [6, 7]}


def test_virtual_stages_go_round_robin_over_the_ranks():
    # Megatron's tables: 8 layers, 2 stages, 2 virtual stages: rank 0 [0, 1] [4, 5], rank 1 [2, 3] [6, 7];
    # 4 virtual stages: rank 0 [0] [2] [4] [6], rank 1 [1] [3] [5] [7].
    assert _layers(_config(8, 2, 2)) == {(0, 0): [0, 1], (0, 1): [2, 3], (1, 0): [4, 5], (1, 1): [6, 7]}
    four = _layers(_config(8, 2, 4))
    assert [four[(v, 0)] for v in range(4)] == [[0], [2], [4], [6]]
    assert [four[(v, 1)] for v in range(4)] == [[1], [3], [5], [7]]


def test_uneven_first_and_last_stages():
    # 10 layers on 4 ranks, 1 first and 3 last: the 6 others split over the 2 middle ranks.
    assert _layers(_config(10, 4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)) == {
        (0, 0): [0], (0, 1): [1, 2, 3], (0, 2): [4, 5, 6], (0, 3): [7, 8, 9]
    }
    # Only the first stage given: the remaining 5 layers all go to the last of 2 ranks.
    assert pipeline_layer_counts(_config(8, 2, num_layers_in_first_pipeline_stage=3)) == [[3, 5]]


def test_uneven_stages_with_virtual_stages():
    # 12 layers, PP 3 (2 first, 2 last, 8 middle), 2 virtual stages: chunks of 1, 4, 1 layers per round;
    # Megatron's offset formula: vp * 6 (+ 1 + 4 (p - 1) for p > 0).
    layers = _layers(_config(12, 3, 2, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2))
    assert layers == {(0, 0): [0], (0, 1): [1, 2, 3, 4], (0, 2): [5], (1, 0): [6], (1, 1): [7, 8, 9, 10], (1, 2): [11]}


def test_embedding_and_loss_counted_as_layers():
    # 6 layers + embedding + loss = 8 over 4 ranks: 2 each, the first and last rank build one layer fewer.
    config = _config(6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert _layers(config) == {(0, 0): [0], (0, 1): [1, 2], (0, 2): [3, 4], (0, 3): [5]}


@pytest.mark.parametrize("num_layers, pp, vpp, split, expected", [
    (6, 4, None, {}, "num_layers (6) must be divisible by pipeline_model_parallel_size (4); valid sizes: 1, 2, 3, 6"),
    (8, 2, 3, {}, "pipeline rank 0 holds 4 layers, not divisible by virtual_pipeline_model_parallel_size (3)"),
    (2, 4, None, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     "(virtual stage, rank) [(0, 0), (0, 3)] would hold no transformer layer"),
    (9, 4, None, dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2),
     "5 layers must split evenly over the 2 other stage(s)"),
    (8, 4, None, dict(num_layers_in_first_pipeline_stage=2, account_for_loss_in_pipeline_split=True),
     "cannot be combined with account_for_embedding/loss_in_pipeline_split"),
])
def test_bad_splits_are_refused_by_the_config(num_layers, pp, vpp, split, expected):
    with pytest.raises(ValueError) as error:
        _config(num_layers, pp, vpp, **split)
    assert expected in str(error.value)
