"""Running one of Megatron-LM's functional-test configurations here: the entries of
tests/fixtures/megatron_functional/configs.json (written by functional_configs.py, whose docstring says how
each command line was made from Megatron-LM's model_config.yaml).

    outcome = validation_outcome(command(entry, scratch), entry["world_size"])   # "valid" or the refusal
    trained = train_in_process(cpu_command(entry, scratch))                      # samples trained

Validation runs at the configuration's own parallel layout (WORLD_SIZE as in Megatron-LM's CI); training runs
in this process on one CPU rank, with the parallel sizes set to 1 (`entry["cpu"]`), for the iterations the
command line asks for. Runs follow one another in one process: each one's global state is undone after it.
"""

import argparse
import contextlib
import gc
import io
import logging
import os
from unittest import mock

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DATA = os.path.join(ROOT, "tests", "fixtures", "megatron_lm", "data")
# Placeholders of the committed command lines; {scratch} is a fresh directory per run.
FIXTURE_PATHS = {"vocab": os.path.join(DATA, "vocab.json"), "merges": os.path.join(DATA, "merges.txt"),
                 "data": os.path.join(DATA, "stdlib_text_document")}


def command(entry: dict, scratch: str) -> list[str]:
    """The configuration's command line with its path placeholders filled."""
    paths = dict(FIXTURE_PATHS, scratch=scratch)
    return [arg.format(**paths) if "{" in arg else arg for arg in entry["argv"]]


def cpu_command(entry: dict, scratch: str) -> list[str]:
    """The command line of the one-rank CPU run: `entry["cpu"]` sets flags to new values (a list, possibly
    empty for a switch) or drops them (None)."""
    argv, overrides = command(entry, scratch), entry["cpu"]
    kept, index = [], 0
    while index < len(argv):
        flag, values = argv[index], []
        index += 1
        while index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        if flag not in overrides:
            kept += [flag, *values]
    for flag, values in overrides.items():
        if values is not None:
            kept += [flag, *values]
    return kept


def _parse(argv: list[str]):
    """Parsed arguments, or the argparse error message (an unknown flag, a bad value), without the
    " (see <program> --help)" that names the running program."""
    from megatron.training import errors
    from megatron.training.arguments import parse_args

    reported = []
    # The parser reports through errors.report_error (once per launch of several ranks); taken here instead.
    with mock.patch.object(errors, "report_error", reported.append):
        try:
            return parse_args(args_list=argv)
        except SystemExit:
            return reported[-1].rsplit(" (see ", 1)[0]


def validation_outcome(argv: list[str], world_size: int) -> str | list[str]:
    """"valid", or what refuses the command line: the argparse error, or validation's list of problems."""
    from megatron.training.arguments import validate_args

    previous = {name: os.environ.get(name) for name in ("WORLD_SIZE", "RANK")}
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        args = _parse(argv)
        if isinstance(args, str):
            return args
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        except ValueError as error:
            return [line[4:] for line in str(error).splitlines()[1:]]
        return "valid"
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _run_state():
    """Undoes what a run leaves in the process: globals, process groups, torch flags, environment, logging."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.training import global_vars

    environment, level = dict(os.environ), logging.getLogger().level
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(name, None)
    try:
        yield
    finally:
        destroy_num_microbatches_calculator()
        global_vars.unset_global_variables()
        get_cuda_rng_tracker().reset()
        if dist.is_initialized():
            dist.destroy_process_group()
        parallel_state.destroy_model_parallel()
        torch.use_deterministic_algorithms(False)
        gc.enable()
        logging.getLogger().setLevel(level)
        os.environ.clear()
        os.environ.update(environment)


def train_in_process(argv: list[str]) -> argparse.Namespace:
    """pretrain_gpt.py's run of `argv` on one CPU rank in this process (its console output swallowed);
    returns its arguments, whose counters say what was trained. Raises what the run raises."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.arguments import validate_args
    from megatron.training.tasks.gpt import forward_step, model_provider, train_valid_test_datasets_provider

    with _run_state():
        args = _parse(argv)
        if isinstance(args, str):
            raise ValueError(args)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            try:
                pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                         forward_step, parsed_args=args)
            except SystemExit as stop:  # an exit condition of the command line (--exit-interval, ...)
                if stop.code not in (0, None):
                    raise
        return args
