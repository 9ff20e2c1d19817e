"""Import a script from tools/ (not a package) as a module, so its `main(argv)` can be tested in-process."""

import importlib.util
import os

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools")


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
