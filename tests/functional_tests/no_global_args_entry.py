"""An entry script run with `get_args()` refusing, for the test that the framework passes the run's arguments
explicitly (tests/functional_tests/test_entry_points.py).

    python no_global_args_entry.py pretrain_gpt.py <its flags>

`get_args` is replaced before any module of the framework is imported, so every `from ... import get_args`
binds the refusing one; only Megatron-LM's compatibility entry points call it, and `pretrain()` takes none.
"""

import os
import runpy
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from megatron.training import global_vars  # noqa: E402


def _refuse():
    raise AssertionError("get_args() was called inside the framework: pass the run's arguments explicitly")


global_vars.get_args = _refuse
script = os.path.join(ROOT, sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
