"""Features not built yet are refused by name instead of being silently ignored."""

import sys
import types

import pytest

from megatron.core.extensions.transformer_engine import (
    TRANSFORMER_IMPL_NOTE,
    is_transformer_engine_available,
    transformer_impl_note,
)
from megatron.training.arguments import build_parser
from megatron.training.arguments.unsupported import UNSUPPORTED

from .conftest import MINIMAL

TE = is_transformer_engine_available()


@pytest.mark.parametrize("flags, expected", [
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8: is not supported yet; use delayed or tensorwise"),
    (["--fp4-format", "e2m1"], "--fp4-format e2m1: FP4 training is not supported yet"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex: is not supported yet; use allgather"),
    (["--moe-router-load-balancing-type", "global_aux_loss"], "--moe-router-load-balancing-type global_aux_loss: is not "
                                                              "supported yet"),
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp: is not supported yet; use torch_dist or torch"),
    (["--async-save", "--ckpt-format", "torch"],
     "--async-save needs --ckpt-format torch_dist (this run has --ckpt-format torch)"),
    (["--ckpt-convert-format", "torch_dist"], "--ckpt-convert-format torch_dist needs --ckpt-convert-save and --load"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl inference_optimized: is not supported yet"),
    (["--position-embedding-type", "yarn"], "--position-embedding-type yarn: is not supported yet"),
    (["--optimizer", "lion"], "--optimizer lion: is not supported yet; use adam, sgd or muon"),
    (["--rerun-mode", "report_stats"], "--rerun-mode report_stats: the re-run engine's determinism statistics are "
                                       "not supported yet"),
    (["--rerun-mode", "validate_results", "--error-injection-type", "correct_result"],
     "--error-injection-type correct_result: injecting a correct result needs Megatron-LM's second re-run"),
    (["--error-injection-rate", "10"], "--error-injection-rate 10 injects errors into the re-run engine's "
                                       "validations, which only run with --rerun-mode validate_results"),
    (["--rerun-mode", "disabled", "--error-injection-rate", "10"], "not with --rerun-mode disabled"),
])
def test_refused_with_a_message(problems, monkeypatch, flags, expected):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert expected in problems(*MINIMAL, *flags)


def test_transformer_engine_runs_the_local_layers_and_says_so(monkeypatch, validated, capsys):
    """Megatron-LM's default --transformer-impl transformer_engine: validated, with one line saying what runs,
    for an installation with TE and one without."""
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # makes `import transformer_engine` fail
    assert transformer_impl_note().endswith("; Transformer Engine is not installed")
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert transformer_impl_note().endswith("; Transformer Engine is installed, but no layer spec here uses it yet")
    capsys.readouterr()
    assert validated(*MINIMAL).transformer_impl == "transformer_engine"
    lines = [line for line in capsys.readouterr().out.splitlines() if "--transformer-impl" in line]
    assert lines == [f"note: --transformer-impl transformer_engine has no effect here: {TRANSFORMER_IMPL_NOTE}; "
                     f"Transformer Engine is {'installed, but no layer spec here uses it yet' if TE else 'not installed'}"]
    validated(*MINIMAL, "--transformer-impl", "local")
    assert "--transformer-impl" not in capsys.readouterr().out


def test_defaults_are_accepted(validated):
    args = validated(*MINIMAL)
    assert (args.ckpt_format, args.transformer_impl, args.optimizer) == ("torch_dist", "transformer_engine", "adam")


def test_every_row_names_a_real_flag():
    known = {option for action in build_parser()._actions for option in action.option_strings}
    assert [row.flag for row in UNSUPPORTED if row.flag not in known] == []
