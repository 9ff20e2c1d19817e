"""Command-line flags declared once, as documented fields of dataclasses; argparse groups made from them.

    @dataclass(kw_only=True)
    class ValidationConfig(Section):
        TITLE = "validation"

        eval_iters: int = 100
        'Iterations per evaluation.'

        skip_train: bool = False
        'Only evaluate (no training iterations).'

        check_for_nan_in_loss_and_grad: bool = flag(True, names=("--no-check-for-nan-in-loss-and-grad",))
        'Do not stop on NaN loss or gradients.'

(the string under each field is its docstring, written with triple quotes in the code).

A field `name` is the flag `--name` (underscores as dashes) with `dest="name"`, its default the field's
default and its help the docstring under it. What argparse needs is read off the annotation and default:

    bool, default False                 store_true
    bool, default True                  store_false under the names given (e.g. --no-..., --disable-...)
    int / float / str (or "| None")     type=int / float / str ("str" needs no type)
    list[X] (or "| None")               type=X, nargs from `flag(nargs=...)` (required for lists)
    anything else                       `flag(type=..., action=...)` says it

`flag()` gives the rest: other or extra `names`, `choices`, `nargs`, `type`, `action`, `metavar`, `hidden`
(kept out of --help), and `off`: the names of a second flag that turns an on-by-default switch off (for a
switch that has both spellings, `--check-for-nan-in-loss-and-grad` and `--no-check-for-nan-in-loss-and-grad`). `Section.add_to(parser)` adds a class's flags as one argument group titled
`TITLE`; `Section.from_namespace(args)` builds the section from parsed arguments.
"""

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, ClassVar

_META = "megatron_flag"
_UNSET = object()


def flag(default=_UNSET, *, default_factory=_UNSET, names: tuple = (), choices=None, nargs=None, type=None,
         action=None, metavar=None, hidden: bool = False, off: tuple = ()):
    """A dataclass field with argparse details that the annotation and default do not say."""
    options = {"names": tuple(names), "choices": choices, "nargs": nargs, "type": type, "action": action,
               "metavar": metavar, "hidden": hidden, "off": tuple(off)}
    metadata = {_META: options}
    if default_factory is not _UNSET:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if default is _UNSET:
        raise TypeError("flag() needs a default (every flag has one)")
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def field_docstrings(cls) -> dict:
    """{field name: the string literal right under its annotation} of `cls` and its dataclass bases."""
    docstrings = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docstrings[statement.target.id] = inspect.cleandoc(following.value.value)
    return docstrings


def _strip_optional(annotation):
    """`X | None` / `Optional[X]` -> X; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _default_of(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"field {field.name} has no default: every flag needs one")


def argparse_kwargs(cls, field: dataclasses.Field) -> tuple[list, dict]:
    """(option strings, add_argument keyword arguments) of one field of `cls` (module docstring)."""
    options = field.metadata.get(_META, {})
    annotation = _strip_optional(typing.get_type_hints(cls)[field.name])
    default = _default_of(field)
    names = list(options.get("names") or (f"--{field.name.replace('_', '-')}",))
    kwargs: dict[str, Any] = {"dest": field.name, "default": default}
    action = options.get("action")
    if action is None and annotation is bool:
        action = "store_false" if default is True else "store_true"
    if action is not None:
        kwargs["action"] = action
    else:
        value_type = options.get("type")
        if typing.get_origin(annotation) in (list, tuple):
            if options.get("nargs") is None:
                raise TypeError(f"{cls.__name__}.{field.name}: a list flag needs flag(nargs=...)")
            value_type = value_type or typing.get_args(annotation)[0]
        elif value_type is None and annotation in (int, float):
            value_type = annotation
        if value_type is not None and value_type is not str:
            kwargs["type"] = value_type
        for key in ("nargs", "choices", "metavar"):
            if options.get(key) is not None:
                kwargs[key] = list(options[key]) if key == "choices" else options[key]
    help_text = field_docstrings(cls).get(field.name)
    kwargs["help"] = argparse.SUPPRESS if options.get("hidden") else help_text
    return names, kwargs


class Section:
    """Base of the configuration sections: one argparse group per class, one instance per run."""

    TITLE: ClassVar[str] = ""

    @classmethod
    def add_to(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds this section's flags to `parser` as the argument group `TITLE`."""
        group = parser.add_argument_group(title=cls.TITLE)
        for field in dataclasses.fields(cls):
            names, kwargs = argparse_kwargs(cls, field)
            group.add_argument(*names, **kwargs)
            off = field.metadata.get(_META, {}).get("off")
            if off:
                group.add_argument(*off, dest=field.name, action="store_false", default=kwargs["default"],
                                   help=f"Turns {names[0]} off.")
        return parser

    def validate(self) -> list[str]:
        """The problems of this section's own flags (rules that involve no other section), each message
        naming the flags and values involved; rules across sections live with the argument validation."""
        return []

    def derived(self) -> dict:
        """{dest: value} that validation writes into the arguments for this section alone: flags left unset
        that default to other flags of the section, and Megatron's couplings between them. Values that need
        several sections are derived with the argument validation."""
        return {}

    @classmethod
    def from_namespace(cls, args: argparse.Namespace):
        """The section's values as parsed (and validated) into `args`; a field missing from `args` (a shorthand
        flag that validation translated and removed) takes its default."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)
                      if hasattr(args, field.name)})
