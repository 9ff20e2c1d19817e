"""Helpers for the argument tests: a single-process environment and a parse+validate shortcut."""

import pytest

from megatron.training.arguments import parse_args, validate_args

# The smallest command line that validates: model shape, batch, length, learning rate.
MINIMAL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3"
).split()


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    """Every test starts as a lone rank 0 of world size 1 (tests that need more set WORLD_SIZE)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def validated():
    """validated(*flags, defaults=None) -> validated namespace."""

    def run(*flags, defaults=None):
        return validate_args(parse_args(args_list=list(flags)), defaults or {})

    return run


@pytest.fixture
def problems():
    """problems(*flags) -> the ValueError message validation raises (fails if it does not raise)."""

    def run(*flags):
        with pytest.raises(ValueError) as error:
            validate_args(parse_args(args_list=list(flags)))
        return str(error.value)

    return run
