"""--dist-ckpt-strictness on one process: a checkpoint holding keys a and b loaded by a model with keys a and
c ("c" unexpected: absent from the checkpoint; "b" missing: asked for by nobody), under each policy."""

import logging

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor, load, save


@pytest.fixture
def checkpoint(tmp_path):
    save({"a": ShardedTensor("a", torch.ones(4), (4,), (0,)), "b": ShardedTensor("b", torch.ones(2), (2,), (0,))},
         str(tmp_path))
    return str(tmp_path)


def _request():
    return {"a": ShardedTensor("a", torch.zeros(4), (4,), (0,)), "c": ShardedTensor("c", torch.zeros(3), (3,), (0,))}


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_keys_absent_from_the_checkpoint_raise_by_name(checkpoint, strict):
    request = {**_request(), "b": ShardedTensor("b", torch.zeros(2), (2,), (0,))}
    with pytest.raises(ValueError, match=f"keys missing from the checkpoint: c \\(--dist-ckpt-strictness {strict}\\)"):
        load(request, checkpoint, strict=strict)


def test_raise_all_also_refuses_checkpoint_keys_nobody_loads(checkpoint):
    with pytest.raises(ValueError, match="holds keys this model does not load: b"):
        load({"a": ShardedTensor("a", torch.zeros(4), (4,), (0,))}, checkpoint, strict="raise_all")


@pytest.mark.parametrize("strict, logged", [("log_unexpected", ["lacks keys this model has (left as they are): c"]),
                                            ("log_all", ["holds keys this model does not load: b",
                                                         "lacks keys this model has (left as they are): c"]),
                                            ("ignore_all", [])])
def test_lenient_policies_load_what_matches(checkpoint, caplog, strict, logged):
    request = _request()
    with caplog.at_level(logging.WARNING):
        loaded = load(request, checkpoint, strict=strict)
    assert torch.equal(loaded["a"], torch.ones(4)) and torch.equal(loaded["c"], torch.zeros(3))
    assert [message for message in logged if message not in caplog.text] == []
    assert ("b" in caplog.text and "does not load" in caplog.text) == (strict == "log_all")


def test_return_policies_hand_back_the_mismatches(checkpoint):
    loaded, unexpected, missing = load(_request(), checkpoint, strict="return_all")
    assert torch.equal(loaded["a"], torch.ones(4)) and (unexpected, missing) == (["c"], ["b"])
    _, unexpected, missing = load(_request(), checkpoint, strict="return_unexpected")
    assert (unexpected, missing) == (["c"], [])
