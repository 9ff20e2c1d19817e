"""Callbacks with Megatron-LM's signatures whose bodies need the run's arguments.

`pretrain()` calls a model provider as `model_provider(pre_process, post_process[, vp_stage])`, a forward step
as `forward_step(data_iterator, model)` and a dataset provider as `provider(train_val_test_num_samples)`: no
room for the arguments, which Megatron-LM's own callbacks read from `get_args()`. The framework's callbacks
(training/tasks/) are written with the arguments first instead,

    @RunCallback
    def forward_step(args, data_iterator, model): ...

and the framework binds them where it hands them over (`bind_args`: the Trainer, `get_model`,
`build_data_iterators`, `train_step`), so the bound callable has Megatron's signature exactly and the run's
arguments travel explicitly. Called unbound, as code written against Megatron-LM calls them
(`forward_step(iterator, model)` after `initialize_megatron`), they read the run's `get_args()`: the
compatibility path, never taken by the framework itself.
"""

import functools
import inspect

from megatron.training import global_vars


class RunCallback:
    """Decorator: `function(args, *megatron_parameters)` as a callback of Megatron's signature (module docstring).
    Attributes set on it (a dataset provider's `is_distributed`) travel with `bind`."""

    def __init__(self, function):
        functools.update_wrapper(self, function)
        self.function = function
        signature = inspect.signature(function)
        # Megatron's signature: what the bound callable takes (`get_model` looks for `vp_stage` in it).
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])

    def bind(self, args):
        """The callable of Megatron's signature with `args` as the run's arguments."""
        bound = functools.partial(self.function, args)
        bound.__dict__.update((name, value) for name, value in vars(self).items()
                              if not name.startswith("__") and name != "function")
        return bound

    def __call__(self, *args, **kwargs):
        """Compatibility entry point: the unbound call of Megatron-LM's scripts, with the run's `get_args()`."""
        return self.function(global_vars.get_args(), *args, **kwargs)


def bind_args(callback, args):
    """`callback` with the run's `args` bound if it takes them (a `RunCallback`); any other callable (a user's
    Megatron-LM callback) as it is."""
    return callback.bind(args) if isinstance(callback, RunCallback) else callback
