"""Reading checkpoints pickled by other code: Megatron-LM saves its whole argparse Namespace, whose values
include Megatron's own enums and config classes (`megatron.core.transformer.enums.CudaGraphScope`, ...),
and every release adds some. Unpickling such a file here must not fail on a class this installation does not
have, or on an enum member it does not know:

    a missing module, class, or enum member   ->  an `UnreadableObject` standing in for it, holding what
                                                  the pickle gave (constructor arguments, state)

Everything else is unpickled as usual. `unreadable_arguments(args)` names the arguments that hold such
placeholders, so a caller can say once which of the checkpoint's arguments it could not read; written again
with `RoundTripPickler`, a placeholder becomes the original object again.
"""

import enum
import pickle
from typing import Dict, Tuple

_PLACEHOLDER_CLASSES: Dict[Tuple[str, str], type] = {}


class UnreadableObject:
    """Stands for an object whose class (or enum member) this installation lacks; `qualified_name` says
    which. The pickle's constructor arguments and state are kept in `args` / `state`."""

    qualified_name = ""

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        instance.args, instance.state = args, None
        return instance

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        shown = ", ".join(map(repr, self.args))
        return f"<unreadable {self.qualified_name}({shown})>"


def _placeholder(module: str, name: str) -> type:
    key = (module, name)
    if key not in _PLACEHOLDER_CLASSES:
        _PLACEHOLDER_CLASSES[key] = type(name, (UnreadableObject,), {"qualified_name": f"{module}.{name}"})
    return _PLACEHOLDER_CLASSES[key]


def _tolerant_enum(enum_class: type, module: str, name: str):
    """`enum_class(value)`, or a placeholder when this installation's enum has no such member."""

    def make(*args):
        try:
            return enum_class(*args)
        except ValueError:
            return _placeholder(module, name)(*args)

    return make


class TolerantUnpickler(pickle.Unpickler):
    """A pickle.Unpickler that puts placeholders where classes are missing (see the module docstring)."""

    def find_class(self, module: str, name: str):
        try:
            found = super().find_class(module, name)
        except (ImportError, AttributeError):
            return _placeholder(module, name)
        if isinstance(found, type) and issubclass(found, enum.Enum):
            return _tolerant_enum(found, module, name)
        return found


class RoundTripPickler(pickle._Pickler):
    """Pickles placeholders back as the objects they stand for (the original class, its arguments and state),
    so that a checkpoint read here and written again (tools/checkpoint/convert.py) still loads in the
    Megatron-LM that wrote it. The pure-Python pickler: the C one cannot write a class reference that does
    not resolve here."""

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, UnreadableObject) and obj is not UnreadableObject:
            module, _, qualified = obj.qualified_name.rpartition(".")
            # The opcode pickle itself writes at this protocol: torch.save's protocol 2 gets GLOBAL, the only
            # one the weights_only unpickler (Megatron-LM's torch-format loader) reads.
            if self.proto >= 4:
                self.save(module)
                self.save(qualified)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + f"{module}\n{qualified}\n".encode("utf-8"))
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def reducer_override(self, obj):
        if isinstance(obj, UnreadableObject):
            return type(obj), obj.args, obj.state
        return NotImplemented


class _PickleModule:
    """What `torch.load(pickle_module=...)` and `torch.save(pickle_module=...)` need: `Unpickler`, `load`,
    `Pickler` (plus the module's other names)."""

    Unpickler = TolerantUnpickler
    Pickler = RoundTripPickler

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return TolerantUnpickler(file, **kwargs).load()


tolerant_pickle_module = _PickleModule()


def _holds_placeholder(value) -> bool:
    if isinstance(value, UnreadableObject):
        return True
    if isinstance(value, dict):
        return any(_holds_placeholder(item) for pair in value.items() for item in pair)
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_placeholder(item) for item in value)
    return False


def holds_placeholders(value) -> bool:
    """Whether `value` (a state dict, args, ...) holds placeholders anywhere in its dicts, lists, attributes."""
    if hasattr(value, "__dict__") and not isinstance(value, (type, UnreadableObject)):
        value = vars(value)
    return _holds_placeholder(value)


def unreadable_arguments(args) -> Dict[str, str]:
    """{argument name: what could not be read} for the attributes of `args` that hold placeholders."""
    found = {}
    for name, value in sorted(vars(args).items()) if hasattr(args, "__dict__") else []:
        if _holds_placeholder(value):
            found[name] = repr(value)
    return found

