"""Checkpoints whose saved arguments hold classes this installation lacks (Megatron-LM's enums and configs):
read with placeholders (a missing module, a missing class, an enum member unknown here), the arguments holding
them named, and written back as the original objects, so the file still loads where those classes exist."""

import argparse
import enum
import sys
import types

import torch

from megatron.core.dist_checkpointing.unpickling import (
    UnreadableObject,
    holds_placeholders,
    tolerant_pickle_module,
    unreadable_arguments,
)
from megatron.training.checkpointing.files import load_checkpoint_file, save_atomically


def _install_module(monkeypatch, name: str, members: dict) -> type:
    """A module `name` holding an Enum `Scope` of `members` (removed again after the test)."""
    module = types.ModuleType(name)
    scope = enum.Enum("Scope", members, module=name)
    module.Scope = scope
    monkeypatch.setitem(sys.modules, name, module)
    return scope


def test_missing_classes_and_members_become_placeholders_and_round_trip(tmp_path, monkeypatch):
    scope = _install_module(monkeypatch, "other_megatron_enums", {"full": 1, "attention": 2})
    args = argparse.Namespace(num_layers=2, scope=scope.attention, scopes=[scope.full], lr=0.1)
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": args, "iteration": 3}, path)

    monkeypatch.delitem(sys.modules, "other_megatron_enums")
    loaded = load_checkpoint_file(path)
    assert loaded["iteration"] == 3 and loaded["args"].num_layers == 2
    assert isinstance(loaded["args"].scope, UnreadableObject) and loaded["args"].scope.args == (2,)
    assert set(unreadable_arguments(loaded["args"])) == {"scope", "scopes"}
    assert holds_placeholders(loaded["args"])
    resaved = str(tmp_path / "resaved.pt")
    save_atomically(loaded, resaved)

    # Where the module exists again, the file holds the original enum members.
    monkeypatch.setitem(sys.modules, "other_megatron_enums", types.ModuleType("other_megatron_enums"))
    monkeypatch.setattr(sys.modules["other_megatron_enums"], "Scope", scope, raising=False)
    back = torch.load(resaved, weights_only=False)
    assert back["args"].scope is scope.attention and back["args"].scopes == [scope.full]
    # Megatron-LM reads its checkpoints with weights_only=True and its enums allow-listed: the file must use
    # only the opcodes of torch.save's protocol, which that unpickler knows.
    with torch.serialization.safe_globals([scope, argparse.Namespace]):
        safe = torch.load(resaved, weights_only=True)
    assert safe["args"].scope is scope.attention


def test_an_enum_member_this_installation_lacks_becomes_a_placeholder(tmp_path, monkeypatch):
    newer = _install_module(monkeypatch, "versioned_enums", {"full": 1, "inference": 3})
    path = str(tmp_path / "state.pt")
    torch.save({"args": argparse.Namespace(scope=newer.inference, other=newer.full)}, path)
    older = enum.Enum("Scope", {"full": 1}, module="versioned_enums")
    monkeypatch.setattr(sys.modules["versioned_enums"], "Scope", older)
    loaded = torch.load(path, weights_only=False, pickle_module=tolerant_pickle_module)
    assert loaded["args"].other is older.full
    assert repr(loaded["args"].scope) == "<unreadable versioned_enums.Scope(3)>"
