"""Layers per (virtual) pipeline stage and their global offsets, against splits worked out by hand
(reference 9.3 and the layer tables of Megatron-Core's transformer_block.py)."""

import pytest
import torch

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_layer_split import (
    get_num_layers_to_build,
    get_transformer_layer_offset,
    pipeline_layer_counts,
)
from megatron.core.transformer.pipeline_parallel_layer_layout import parse_layout_string
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


def test_embedding_and_loss_may_leave_chunks_without_layers():
    # Megatron-LM's functional test: 6 layers + embedding + loss over PP 4 x VPP 2, one per chunk; the
    # first chunk keeps only the embedding and the last only the loss (Megatron-Core allows 0 layers).
    config = _config(6, 4, 2, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert _layers(config) == {(0, 0): [], (0, 1): [0], (0, 2): [1], (0, 3): [2],
                               (1, 0): [3], (1, 1): [4], (1, 2): [5], (1, 3): []}


def test_layout_string_grammar():
    # Megatron-LM's example: "Ettt|(tt|)*29,m|L" is [E t t t], 29 x [t t], [m], [L].
    stages = parse_layout_string("Ettt|(tt|)*29,m|L")
    assert len(stages) == 32 and stages[0] == [LayerType.embedding] + [LayerType.decoder] * 3
    assert all(stage == [LayerType.decoder] * 2 for stage in stages[1:30])
    assert stages[30:] == [[LayerType.mtp], [LayerType.loss]]
    embedding, decoder, loss = LayerType.embedding, LayerType.decoder, LayerType.loss
    assert parse_layout_string("E|(t|)*2L") == [[embedding], [decoder], [decoder], [loss]]  # "E|t|t|L"
    assert parse_layout_string("Et*2,|tL") == [[embedding, decoder, decoder], [decoder, loss]]
    with pytest.raises(ValueError, match="unknown character"):
        parse_layout_string("E|tx|L")


def test_layout_places_layers_in_execution_order():
    # Megatron-LM's functional test (16 layers, 1 MTP depth, PP 2): 8 stages, 4 virtual stages per rank;
    # stage k is virtual stage k // 2 of rank k % 2 and the t's are numbered along the string.
    config = _config(16, 2, pipeline_model_parallel_layout="Et*3|(tt|)*6tmL", mtp_num_layers=1)
    assert config.virtual_pipeline_model_parallel_size == 4
    layers = _layers(config)
    assert [layers[(v, 0)] for v in range(4)] == [[0, 1, 2], [5, 6], [9, 10], [13, 14]]
    assert [layers[(v, 1)] for v in range(4)] == [[3, 4], [7, 8], [11, 12], [15]]
    # A chunk may hold no layer; without virtual stages the layout is PP stages.
    assert pipeline_layer_counts(_config(4, 2, pipeline_model_parallel_layout="E|tt|t|tL")) == [[0, 2], [1, 1]]
    assert pipeline_layer_counts(_config(4, 2, pipeline_model_parallel_layout="Et|tttL")) == [[1, 3]]


@pytest.mark.parametrize("num_layers, layout, extra, expected", [
    (4, "E|tt|t|t", {}, "must start with the embedding E and end with the loss L"),
    (5, "E|tt|t|tL", {}, "holds 4 transformer layer(s) t, but --num-layers is 5"),
    (4, "Et|tt|tL", {}, "has 3 stage(s), which must be a positive multiple of pipeline_model_parallel_size (2)"),
    (4, "Et|m|tt|tL", dict(mtp_num_layers=1), "every MTP layer m must come after the last transformer layer t"),
    (4, "Ett|tt|m|L", dict(mtp_num_layers=1), "standalone MTP) are not supported yet"),
    (4, "Ett|tmL", {}, "holds 1 MTP layer(s) m, but --mtp-num-layers is None"),
    (4, "Ett|ttL", dict(account_for_loss_in_pipeline_split=True), "a pipeline layout cannot be combined"),
])
def test_bad_layouts_are_refused_by_the_config(num_layers, layout, extra, expected):
    with pytest.raises(ValueError) as error:
        _config(num_layers, 2, pipeline_model_parallel_layout=layout, **extra)
    assert expected in str(error.value)


@pytest.mark.parametrize("num_layers, pp, vpp, split, expected", [
    (6, 4, None, {}, "num_layers (6) must be divisible by pipeline_model_parallel_size (4); valid sizes: 1, 2, 3, 6"),
    (8, 2, 3, {}, "pipeline rank 0 holds 4 layers, not divisible by virtual_pipeline_model_parallel_size (3)"),
    (9, 4, None, dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2),
     "5 layers must split evenly over the 2 other stage(s)"),
    (8, 4, None, dict(num_layers_in_first_pipeline_stage=2, account_for_loss_in_pipeline_split=True),
     "cannot be combined with account_for_embedding/loss_in_pipeline_split"),
])
def test_bad_splits_are_refused_by_the_config(num_layers, pp, vpp, split, expected):
    with pytest.raises(ValueError) as error:
        _config(num_layers, pp, vpp, **split)
    assert expected in str(error.value)
