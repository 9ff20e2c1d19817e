"""Features not built yet are refused by name instead of being silently ignored."""

import argparse
import sys
import types

import pytest

from megatron.core.extensions.transformer_engine import TRANSFORMER_IMPL_REFUSAL
from megatron.training.arguments import build_parser
from megatron.training.arguments.unsupported import UNSUPPORTED, find_unsupported

from .conftest import MINIMAL


@pytest.mark.parametrize("flags, expected", [
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8: is not supported yet; use delayed or tensorwise"),
    (["--fp8-param-gather"], "--fp8-param-gather: FP8 parameters and all-gathers are not supported yet"),
    (["--fp4-format", "e2m1"], "--fp4-format e2m1: FP4 training is not supported yet"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex: is not supported yet; use allgather"),
    (["--moe-router-load-balancing-type", "sinkhorn"], "--moe-router-load-balancing-type sinkhorn: is not supported yet"),
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp: is not supported yet; use torch_dist or torch"),
    (["--async-save", "--ckpt-format", "torch"],
     "--async-save needs --ckpt-format torch_dist (this run has --ckpt-format torch)"),
    (["--ckpt-convert-format", "torch_dist"], "--ckpt-convert-format torch_dist needs --ckpt-convert-save and --load"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: Transformer Engine "
                                                   "layers are not built here yet; use --transformer-impl local"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl inference_optimized: is not supported yet"),
    (["--position-embedding-type", "yarn"], "--position-embedding-type yarn: is not supported yet"),
    (["--optimizer", "muon"], "--optimizer muon: is not supported yet; use adam or sgd"),
])
def test_refused_with_a_message(problems, monkeypatch, flags, expected):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert expected in problems(*MINIMAL, *flags)


def test_transformer_engine_refusal_says_whether_te_is_installed(monkeypatch):
    args = argparse.Namespace(transformer_impl="transformer_engine")
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # makes `import transformer_engine` fail
    assert find_unsupported(args) == [
        f"--transformer-impl transformer_engine: {TRANSFORMER_IMPL_REFUSAL}. Transformer Engine is not installed "
        'either: `pip install "megatron[te]"` (transformer-engine[pytorch], needs CUDA)']
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert find_unsupported(args) == [
        f"--transformer-impl transformer_engine: {TRANSFORMER_IMPL_REFUSAL}. Transformer Engine is installed, but "
        "nothing here uses it yet"]


def test_defaults_are_accepted(validated):
    args = validated(*MINIMAL)
    assert (args.ckpt_format, args.transformer_impl, args.optimizer) == ("torch_dist", "local", "adam")


def test_every_row_names_a_real_flag():
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert [row.flag for row in UNSUPPORTED if row.flag not in known] == []
