"""Flags declared as dataclass fields (megatron/training/config/fields.py): the argparse groups made from them."""

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from megatron.training.config.fields import Section, flag


@dataclass(kw_only=True)
class _Example(Section):
    TITLE = "example"

    micro_batch_size: int | None = None
    """Sequences per forward pass."""

    lr: float = 1e-4
    """Learning rate."""

    name: str | None = None
    """A name."""

    skip_train: bool = False
    """Only evaluate."""

    add_bias_linear: bool = flag(True, names=("--disable-bias-linear",))
    """Remove the biases."""

    recompute_granularity: str | None = flag(None, choices=("full", "selective"))
    """What to recompute."""

    rampup_batch_size: list[int] | None = flag(None, nargs="*")
    """<start> <increment> <samples>."""

    profile_ranks: list[int] = flag(default_factory=list, nargs="*")
    """Ranks to profile."""

    legacy: bool | None = flag(None, action="store_true", hidden=True)
    """Not shown."""


def _parse(*argv):
    return _Example.add_to(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_types_and_actions():
    args = _parse()
    assert vars(args) == {"micro_batch_size": None, "lr": 1e-4, "name": None, "skip_train": False,
                          "add_bias_linear": True, "recompute_granularity": None, "rampup_batch_size": None,
                          "profile_ranks": [], "legacy": None}
    args = _parse("--micro-batch-size", "4", "--lr", "3e-4", "--name", "x", "--skip-train", "--disable-bias-linear",
                  "--recompute-granularity", "full", "--rampup-batch-size", "16", "16", "100", "--profile-ranks",
                  "0", "3", "--legacy")
    assert (args.micro_batch_size, args.lr, args.name, args.skip_train, args.add_bias_linear) == (4, 3e-4, "x", True,
                                                                                                 False)
    assert (args.recompute_granularity, args.rampup_batch_size, args.profile_ranks, args.legacy) == (
        "full", [16, 16, 100], [0, 3], True)
    assert _Example.from_namespace(args).rampup_batch_size == [16, 16, 100]


def test_help_comes_from_the_docstrings_and_hidden_flags_stay_out(capsys):
    with pytest.raises(SystemExit):
        _parse("--help")
    text = capsys.readouterr().out
    assert "example:" in text and "Sequences per forward pass." in text and "Remove the biases." in text
    assert "--legacy" not in text


def test_choices_are_checked(capsys):
    with pytest.raises(SystemExit):
        _parse("--recompute-granularity", "everything")
    assert "invalid choice: 'everything'" in capsys.readouterr().err


def test_a_list_needs_nargs_and_a_flag_needs_a_default():
    @dataclass(kw_only=True)
    class Broken(Section):
        sizes: list[int] | None = None

    with pytest.raises(TypeError, match="a list flag needs flag"):
        Broken.add_to(argparse.ArgumentParser())
    with pytest.raises(TypeError, match="needs a default"):
        flag(names=("--x",))


def test_literal_annotations_need_no_type():
    @dataclass(kw_only=True)
    class Choice(Section):
        mode: Literal["a", "b"] = flag("a", choices=("a", "b"))
        """A mode."""

    assert Choice.add_to(argparse.ArgumentParser()).parse_args(["--mode", "b"]).mode == "b"


def test_a_switch_with_both_spellings():
    @dataclass(kw_only=True)
    class Checks(Section):
        check_nan: bool = flag(True, action="store_true", off=("--no-check-nan",))
        """Check for NaN (default on)."""

    parser = Checks.add_to(argparse.ArgumentParser())
    assert [parser.parse_args(argv).check_nan for argv in ([], ["--check-nan"], ["--no-check-nan"])] == [
        True, True, False]
    assert "Turns --check-nan off." in parser.format_help()
