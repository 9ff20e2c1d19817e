"""No flag is accepted and then ignored: every dest of the parser is read by some code, or the flag is
refused by validation with the reason, or it is a flag without effect here that prints why (without_effect.py).

"Read" means the dest appears in the source tree (megatron/ and the pretrain_*.py scripts) as an attribute
read (`args.log_params_norm`, `config.hidden_dropout`), a string (`getattr(args, "name")`, the renamed-field
tables of core_configs.py) or a keyword argument, outside the code that only validates: functions named
`validate`, `check_*`, `_check_*` or `*_problems`. A flag declaration (`dest="..."`) is not a read.
"""

import ast
import io
import os
from contextlib import redirect_stdout

import pytest

from megatron.training.arguments import build_parser, parse_args, validate_args
from megatron.training.arguments.deprecated import DEPRECATED_FLAGS
from megatron.training.arguments.unsupported import UNSUPPORTED
from megatron.training.arguments.without_effect import WITHOUT_EFFECT

from .conftest import MINIMAL

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))

# Flags whose only reader is validation, each refused there for any value but its default: the command line
# that asks for it, and the reason the refusal gives.
REFUSED_BY_VALIDATION = {
    # per-layer CUDA graphs are not built; with --cuda-graph-impl full_iteration the list must be empty
    "cuda_graph_modules": (["--cuda-graph-modules", "attn"], "--cuda-graph-modules attn: per-layer CUDA graphs "
                                                             "(--cuda-graph-impl local or transformer_engine) are "
                                                             "not supported yet"),
    "activation_offload_fraction": (["--activation-offload-fraction", "0.5"], "--activation-offload-fraction 0.5: "
                                    "offloading a fraction of the groups is not supported yet"),
    "delta_offload_bytes_across_pp_ranks": (["--delta-offload-bytes-across-pp-ranks", "1024"],
                                            "--delta-offload-bytes-across-pp-ranks 1024: balancing the offloaded "
                                            "bytes over pipeline ranks is not supported yet"),
}

# Flags without effect that Megatron-LM accepts only with others (its rules, validate_overlap.py): a command
# line that asks for each, on two ranks.
_INTERLEAVED = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                "1", "--global-batch-size", "8"]
_EP_OVERLAP = ["--num-experts", "2", "--expert-model-parallel-size", "2", "--bf16", "--moe-token-dispatcher-type",
               "alltoall", "--overlap-moe-expert-parallel-comm"]
WITHOUT_EFFECT_PROBES = {
    "--num-distributed-optimizer-instances": ["--num-distributed-optimizer-instances", "2",
                                              "--use-distributed-optimizer"],
    "--overlap-param-gather-with-optimizer-step": [*_INTERLEAVED, "--use-distributed-optimizer", "--overlap-grad-reduce",
                                                   "--overlap-param-gather",
                                                   "--overlap-param-gather-with-optimizer-step"],
    "--defer-embedding-wgrad-compute": ["--pipeline-model-parallel-size", "2", "--defer-embedding-wgrad-compute"],
    "--overlap-p2p-communication-warmup-flush": [*_INTERLEAVED, "--overlap-p2p-communication-warmup-flush"],
    "--overlap-moe-expert-parallel-comm": _EP_OVERLAP,
    "--delay-wgrad-compute": [*_EP_OVERLAP, "--delay-wgrad-compute"],
}

_VALIDATION_FUNCTIONS = ("validate",)


def _is_validation(name: str) -> bool:
    return name in _VALIDATION_FUNCTIONS or name.startswith(("check_", "_check_")) or name.endswith("_problems")


def _source_files() -> list:
    files = [os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.startswith("pretrain_")
             and name.endswith(".py")]
    for directory, _, names in os.walk(os.path.join(ROOT, "megatron")):
        files += [os.path.join(directory, name) for name in names if name.endswith(".py")]
    return files


def _names_read(tree: ast.AST) -> set:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_validation(node.name):
            skipped.update(id(inner) for inner in ast.walk(node))
        elif isinstance(node, ast.keyword) and node.arg == "dest":
            skipped.add(id(node.value))  # a declaration, not a read
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return names


@pytest.fixture(scope="module")
def names_read() -> set:
    names = set()
    for path in _source_files():
        with open(path) as source:
            names |= _names_read(ast.parse(source.read(), path))
    return names


def _actions() -> dict:
    """{dest: action} of every flag (deprecated flags are translated by deprecated.py and then removed)."""
    deprecated = {entry.dest for entry in DEPRECATED_FLAGS}
    return {action.dest: action for action in build_parser()._actions
            if action.option_strings and action.dest not in deprecated | {"help", "config_file"}}


def _dests_of(rows) -> set:
    by_flag = {option: action.dest for action in build_parser()._actions for option in action.option_strings}
    return {by_flag[row.flag] for row in rows}


def test_every_flag_is_read_refused_or_noted(names_read):
    refused = _dests_of(row for row in UNSUPPORTED if not row.values)
    noted = _dests_of(WITHOUT_EFFECT)
    unread = sorted(f"{action.option_strings[0]} (args.{dest})" for dest, action in _actions().items()
                    if dest not in names_read | refused | noted | set(REFUSED_BY_VALIDATION))
    assert unread == [], "flags that no code reads: read them, refuse them (unsupported.py) or note them " \
                         f"(without_effect.py): {unread}"


def test_allow_listed_flags_are_really_unread_elsewhere(names_read):
    """An allow-list entry whose flag gained a reader must leave the list."""
    assert [dest for dest in REFUSED_BY_VALIDATION if dest in names_read] == []


def _problems(flags) -> str:
    with pytest.raises(ValueError) as error:
        validate_args(parse_args(args_list=[*MINIMAL, *flags]))
    return str(error.value)


@pytest.mark.parametrize("dest", sorted(REFUSED_BY_VALIDATION))
def test_allow_listed_flags_are_refused(dest):
    flags, reason = REFUSED_BY_VALIDATION[dest]
    assert reason in _problems(flags)


def _non_default_argv(action, row=None) -> list:
    """The flag of `action` with a value its table row names, else one other than its default."""
    flag = action.option_strings[0]
    if row is not None and row.values:
        return [flag, str(row.values[0])]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(next(choice for choice in action.choices if choice != action.default))]
    return [flag, "x" if action.type in (None, str) else "2"]


@pytest.mark.parametrize("row", [row for row in UNSUPPORTED if not row.values], ids=lambda row: row.flag)
def test_wholly_unsupported_flags_are_refused(row):
    action = _actions()[_dests_of([row]).pop()]
    assert f": {row.message}" in _problems(_non_default_argv(action))


@pytest.mark.parametrize("row", WITHOUT_EFFECT, ids=lambda row: row.flag)
def test_flags_without_effect_say_why(row, monkeypatch):
    action = _actions()[_dests_of([row]).pop()]
    monkeypatch.setenv("WORLD_SIZE", "2")
    output = io.StringIO()
    with redirect_stdout(output):
        flags = WITHOUT_EFFECT_PROBES.get(row.flag) or _non_default_argv(action, row)
        validate_args(parse_args(args_list=[*MINIMAL, *flags]))
    assert f"{row.flag}" in output.getvalue() and row.reason in output.getvalue()
