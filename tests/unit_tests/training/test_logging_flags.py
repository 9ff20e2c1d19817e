"""--logging-level and --wandb-entity reach the logging module and wandb.init as in Megatron-LM."""

import argparse
import logging
import sys
import types

import pytest

from megatron.training import initialize


@pytest.fixture
def root_level():
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def test_logging_level_flag_wins_over_the_environment(root_level, monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
    initialize._set_logging_level(argparse.Namespace(logging_level=None))
    assert logging.getLogger().level == 40
    initialize._set_logging_level(argparse.Namespace(logging_level=10))
    assert logging.getLogger().level == 10


def test_wandb_entity_goes_to_wandb_init(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: calls.append(kwargs)))
    monkeypatch.setattr(initialize.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(initialize.dist, "get_world_size", lambda: 1)
    args = argparse.Namespace(tensorboard_dir=None, log_memory_to_tensorboard=False, wandb_project="p",
                              wandb_exp_name="run", wandb_save_dir=str(tmp_path), wandb_entity="team", save=None)
    initialize._set_writers(args)
    assert [(call["project"], call["name"], call["entity"]) for call in calls] == [("p", "run", "team")]
