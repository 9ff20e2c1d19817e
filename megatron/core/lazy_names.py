"""Names of a package that are imported on first use (a module-level `__getattr__`, PEP 562).

A package lists, for each such name, the module that defines it; `import package` then loads none of those
modules, and `package.name` or `from package import name` loads the one it needs. The packages use it for
names whose modules are heavy to import and which many runs never touch (torch.distributed.checkpoint,
FSDP2 and DTensor, torch._dynamo, the training loop from the checkpoint tools).
"""

import importlib
from typing import Callable, Dict


def lazy_names(package: str, modules: Dict[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package` for `modules` = {name: module defining it}, a module path absolute or
    relative to `package` (".serialization")."""

    def __getattr__(name: str):
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
