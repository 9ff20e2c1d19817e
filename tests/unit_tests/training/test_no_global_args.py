"""Nothing inside the framework reads the run's arguments from `get_args()`: they travel explicitly (the
Trainer's `args`, bound into the task callbacks by run_callbacks.py). `get_args()` stays for code written
against Megatron-LM, and the only calls under megatron/ are the compatibility entry points below: Megatron-LM's
functions whose signatures have no parameter for the arguments."""

import ast
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

COMPATIBILITY_ENTRY_POINTS = {
    ("megatron/training/run_callbacks.py", "RunCallback.__call__"),
    ("megatron/training/training.py", "get_optimizer_param_scheduler"),
    ("megatron/training/training.py", "setup_model_and_optimizer"),
    ("megatron/training/step.py", "train_step"),
    ("megatron/training/data_iterators.py", "build_train_valid_test_data_iterators"),
    ("megatron/training/model_chunks.py", "get_model"),
    ("megatron/training/checkpointing/saving.py", "save_checkpoint"),
    ("megatron/training/checkpointing/loading.py", "load_checkpoint"),
    ("megatron/training/checkpointing/checkpoint_args.py", "check_checkpoint_args"),
    ("megatron/training/tasks/gpt.py", "validate_loss"),
}


def _global_args_reads(path: str):
    """(function qualname, docstring) of each `get_args()` call (or `_ARGS` read) in the file at `path`."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []

    def visit(node, scope: list, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name], child if not isinstance(child, ast.ClassDef) else function)
                continue
            name = None
            if isinstance(child, ast.Call) and not child.args and not child.keywords:
                name = getattr(child.func, "id", None) or getattr(child.func, "attr", None)
            elif isinstance(child, ast.Attribute) and child.attr == "_ARGS":
                name = "_ARGS"
            if name in ("get_args", "_ARGS"):
                found.append((".".join(scope) or "<module>", ast.get_docstring(function) if function else None))
            visit(child, scope, function)

    visit(tree, [], None)
    return found


def _framework_reads() -> dict:
    reads = {}
    for directory, _, files in os.walk(os.path.join(ROOT, "megatron")):
        for name in sorted(files):
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if name.endswith(".py") and relative != "megatron/training/global_vars.py":
                for function, docstring in _global_args_reads(path):
                    reads[(relative, function)] = docstring
    return reads


def test_only_compatibility_entry_points_call_get_args():
    reads = _framework_reads()
    unexpected = sorted(set(reads) - COMPATIBILITY_ENTRY_POINTS)
    assert not unexpected, (
        "framework code reads the run's arguments from get_args(); pass them explicitly (the Trainer's args, or "
        f"a callback taking them first, bound by run_callbacks.bind_args): {unexpected}"
    )
    # The list stays true: each entry point still reads them there, and says so in its docstring.
    assert set(reads) == COMPATIBILITY_ENTRY_POINTS, sorted(COMPATIBILITY_ENTRY_POINTS - set(reads))
    undocumented = sorted(key for key, docstring in reads.items()
                          if "compatibility entry point" not in " ".join((docstring or "").lower().split()))
    assert not undocumented, f"say 'compatibility entry point' in the docstrings of {undocumented}"


def test_the_scan_finds_a_call(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("import typing\n"
                      "class Task:\n"
                      "    def step(self):\n"
                      "        return get_args().seq_length + len(typing.get_args(int))\n"
                      "def helper():\n"
                      "    return global_vars._ARGS\n")
    assert [function for function, _ in _global_args_reads(str(source))] == ["Task.step", "helper"]
