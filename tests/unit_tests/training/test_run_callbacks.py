"""A task callback taking the run's arguments first keeps Megatron-LM's signature once bound, with the
attributes the framework reads (`is_distributed`), and called unbound it reads the run's `get_args()`."""

import argparse
import inspect

from megatron.training import global_vars
from megatron.training.run_callbacks import RunCallback, bind_args
from megatron.training.tasks import gpt


@RunCallback
def _provider(args, train_val_test_num_samples):
    return args.seed, train_val_test_num_samples


_provider.is_distributed = True


def test_bound_callback_has_megatrons_signature_and_attributes():
    bound = bind_args(_provider, argparse.Namespace(seed=7))
    assert bound([1, 2, 3]) == (7, [1, 2, 3])
    assert bound.is_distributed is True
    assert list(inspect.signature(_provider).parameters) == ["train_val_test_num_samples"]
    # get_model passes vp_stage to a provider whose (bound) signature has it.
    model_provider = bind_args(gpt.model_provider, argparse.Namespace())
    assert list(inspect.signature(model_provider).parameters) == ["pre_process", "post_process", "vp_stage"]


def test_other_callables_are_handed_over_as_they_are():
    def forward_step(data_iterator, model):
        return data_iterator, model

    assert bind_args(forward_step, argparse.Namespace()) is forward_step


def test_unbound_call_reads_the_runs_arguments():
    global_vars.set_args(argparse.Namespace(seed=11))
    try:
        assert _provider([4]) == (11, [4])
    finally:
        global_vars.unset_global_variables()
