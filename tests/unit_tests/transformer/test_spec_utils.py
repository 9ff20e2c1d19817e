"""build_module: classes, specs with params and import paths, and function slots."""

import pytest
import torch

from megatron.core.transformer.bias_dropout_add import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


def test_spec_by_import_path_with_params():
    linear = build_module(ModuleSpec(module=("torch.nn", "Linear"), params={"bias": False}), 3, 2)
    assert isinstance(linear, torch.nn.Linear) and linear.bias is None and linear.weight.shape == (2, 3)


def test_class_and_function_slots():
    assert isinstance(build_module(torch.nn.ReLU), torch.nn.ReLU)
    assert build_module(get_bias_dropout_add) is get_bias_dropout_add
    bda = build_module(ModuleSpec(module=get_bias_dropout_add))(False, False)
    x, bias, residual = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    torch.testing.assert_close(bda((x, bias), residual, 0.5), torch.full((2,), 6.0))  # no dropout in eval


def test_other_objects_are_rejected():
    with pytest.raises(TypeError, match="ModuleSpec, a class or a function"):
        build_module("torch.nn.Linear")
