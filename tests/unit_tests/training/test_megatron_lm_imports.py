"""The import paths of Megatron-LM's entry scripts: `from megatron.training import get_args, pretrain, ...`,
`from megatron.training.checkpointing import load_checkpoint, save_checkpoint, ...` and, for scripts written
against Megatron-LM <= v0.16, `from megatron.training.tokenizer import build_tokenizer`."""

import importlib

import pytest

from megatron.core import tokenizers


@pytest.mark.parametrize(
    "name, module",
    [("get_args", "global_vars"), ("get_tokenizer", "global_vars"), ("get_timers", "global_vars"),
     ("get_tensorboard_writer", "global_vars"), ("get_wandb_writer", "global_vars"),
     ("print_rank_0", "console"), ("print_rank_last", "console"), ("is_last_rank", "console"),
     ("initialize_megatron", "initialize"), ("pretrain", "training")],
)
def test_megatron_training_exports_the_names_of_megatron_lm(name, module):
    training = importlib.import_module("megatron.training")
    assert getattr(training, name) is getattr(importlib.import_module(f"megatron.training.{module}"), name)


def test_unknown_name_is_an_attribute_error():
    import megatron.training

    with pytest.raises(AttributeError, match="has no attribute 'get_model_provider'"):
        megatron.training.get_model_provider


def test_old_tokenizer_module_path_builds_the_same_tokenizers():
    from megatron.training.tokenizer import build_tokenizer

    assert build_tokenizer is tokenizers.build_tokenizer


@pytest.mark.parametrize(
    "name, module",
    [("load_checkpoint", "loading"), ("save_checkpoint", "saving"), ("get_checkpoint_name", "layout"),
     ("get_checkpoint_tracker_filename", "layout"), ("read_metadata", "layout"),
     ("load_args_from_checkpoint", "checkpoint_args"), ("generate_state_dict", "state_dict")],
)
def test_megatron_training_checkpointing_exports_the_names_of_megatron_lm(name, module):
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    assert name in checkpointing.__all__
    assert getattr(checkpointing, name) is getattr(importlib.import_module(f"megatron.training.checkpointing.{module}"),
                                                   name)
    with pytest.raises(AttributeError, match="has no attribute 'save_checkpoint_async'"):
        checkpointing.save_checkpoint_async
