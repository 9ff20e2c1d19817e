"""The tokenizers and the preprocessing engine import on a machine without torch (tools/preprocess_data.py).

Each package is imported, every module of it, in a fresh interpreter where a `sys.meta_path` finder makes
`import torch` fail and records the attempt, so that a guarded import (`try: import torch`) is caught too.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

IMPORT_ALL_WITHOUT_TORCH = """
import importlib, json, pkgutil, sys

attempts = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
package = importlib.import_module(sys.argv[1])
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(module.name)
print(json.dumps({"attempts": attempts, "modules": sorted(sys.modules)}))
"""

# What each package may load of megatron besides itself: the tokenizers nothing; the preprocessing engine
# the tokenizers, the .bin/.idx writer and the tokenizer record written next to it.
ALLOWED = {
    "megatron.core.tokenizers": {"megatron", "megatron.core"},
    "megatron.preprocessing": {"megatron", "megatron.core", "megatron.core.tokenizers", "megatron.core.datasets",
                               "megatron.core.datasets.indexed_dataset", "megatron.core.datasets.tokenizer_record",
                               "megatron.core.atomic_write"},
}


def _package_of(module: str) -> str:
    return "megatron.core.tokenizers" if module.startswith("megatron.core.tokenizers.") else module


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_without_torch_megatron_outside_or_optional_back_ends(package):
    result = subprocess.run([sys.executable, "-c", IMPORT_ALL_WITHOUT_TORCH, package], cwd=REPO,
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["attempts"] == []
    optional = ("torch", "transformers", "sentencepiece", "tiktoken", "nltk", "zstandard")
    assert [m for m in report["modules"] if m.split(".")[0] in optional] == []
    outside = {
        _package_of(m) for m in report["modules"]
        if m.split(".")[0] == "megatron" and m != package and not m.startswith(package + ".")
    }
    assert outside <= ALLOWED[package]
