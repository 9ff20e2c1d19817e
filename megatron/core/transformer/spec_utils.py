"""Layer specs: which module class fills each slot of a layer, built later with the config.

A `ModuleSpec` names a class (or an importable `(module_path, name)` pair), extra constructor
`params`, and a `submodules` dataclass of nested specs. `build_module(spec, *args, **kwargs)` instantiates
it; a plain function in a slot (e.g. `get_bias_dropout_add`) is returned unchanged.
"""

import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Tuple, Union


@dataclass
class ModuleSpec:
    """What to build in one slot: `module(*args, **params, submodules=submodules, **kwargs)`."""

    module: Union[Tuple[str, str], type, types.FunctionType]
    params: dict = field(default_factory=dict)
    submodules: Any = None


def import_module(module_path: Tuple[str, str]):
    """Returns the object `name` from module `base`, for specs given as `("pkg.mod", "Name")`."""
    base, name = module_path
    return getattr(importlib.import_module(base), name)


def build_module(spec_or_module, *args, **kwargs):
    """Instantiates a spec, a class, or returns a function slot as is."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    if isinstance(spec_or_module, ModuleSpec):
        module = spec_or_module.module
        if isinstance(module, tuple):
            module = import_module(module)
        params, submodules = spec_or_module.params, spec_or_module.submodules
    elif isinstance(spec_or_module, type):
        module, params, submodules = spec_or_module, {}, None
    else:
        raise TypeError(f"build_module expects a ModuleSpec, a class or a function, got {spec_or_module!r}")
    if isinstance(module, types.FunctionType):
        return module
    if submodules is not None:
        kwargs["submodules"] = submodules
    return module(*args, **params, **kwargs)
