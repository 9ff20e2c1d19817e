"""`tools/checkpoint/convert.py`: Megatron's checkpoint converter, with its flags and plugin design (reference 8.3).

    python tools/checkpoint/convert.py --model-type GPT --loader core --saver core \\
        --load-dir ckpt/tp1 --save-dir ckpt/tp2 --target-tensor-parallel-size 2
    python tools/checkpoint/convert.py --model-type GPT --loader core --saver hf --load-dir ckpt --save-dir hf-model
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver core --load-dir hf-model --save-dir ckpt

A plugin is a module with `add_arguments(parser)` and `load_checkpoint(queue, args)` (loaders) or
`save_checkpoint(queue, args)` (savers); `--loader NAME` looks for
`megatron.training.checkpointing.conversion.loader_NAME`, then `loader_NAME` and `NAME` on the Python path.
The loader `put`s the metadata, the model messages and "done" on the queue; the saver `get`s them.

Departure from Megatron: the saver runs in a thread of this process instead of a child process. The
messages are the same; tensors are handed over without pickling, and an error on either side stops
the other and is raised here with its traceback (a failed child process in Megatron leaves the other
side waiting on the queue).
"""

import argparse
import importlib
import queue
import threading

from megatron.training.errors import ArgumentParser

_PACKAGE = "megatron.training.checkpointing.conversion"
_OLD_NAMES = {"megatron": "core", "mcore": "core", "legacy": "core"}
_POLL_SECONDS = 0.1


def load_plugin(kind: str, name: str):
    """The loader/saver module for `--loader`/`--saver NAME`, or a ValueError listing where it looked."""
    name = _OLD_NAMES.get(name, name)
    candidates = (f"{_PACKAGE}.{kind}_{name}", f"{kind}_{name}", name)
    for module_name in candidates:
        try:
            plugin = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the plugin exists but imports something missing
            continue
        entry = "load_checkpoint" if kind == "loader" else "save_checkpoint"
        if not (hasattr(plugin, "add_arguments") and hasattr(plugin, entry)):
            raise ValueError(f"--{kind} {name}: module {module_name} has no add_arguments/{entry}, it is not a {kind}")
        return plugin
    raise ValueError(f"--{kind} {name}: no such {kind}; built in: core, hf (looked for {', '.join(candidates)})")


class SaverStopped(RuntimeError):
    """The loader's `put` after the saver thread ended: the saver's own error (if any) is the one to report."""


class MessageQueue:
    """A bounded queue between the loader (this thread) and the saver thread that gives up, instead of
    waiting forever, once the other side has stopped (failed, or a saver returned early)."""

    def __init__(self, maxsize: int):
        self._queue = queue.Queue(maxsize=maxsize)
        self.stopped = threading.Event()

    def put(self, message) -> None:
        while not self.stopped.is_set():
            try:
                self._queue.put(message, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue
        raise SaverStopped("the saver has stopped before taking every message; stopping the loader")

    def get(self):
        while True:
            try:
                return self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if self.stopped.is_set():
                    return "exit"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Megatron checkpoint converter: reshard torch-format checkpoints (TP/PP, vocabulary padding) "
                    "and convert to / from Hugging Face. Model weights only: optimizer, scheduler and RNG state "
                    "(and distrib_optim.pt) are not converted, so resume with --no-load-optim --no-load-rng.",
        allow_abbrev=False, conflict_handler="resolve", add_help=False,  # --help comes after the plugins' flags
    )
    parser.add_argument("--model-type", required=True, choices=["GPT", "BERT"], help="type of the model")
    parser.add_argument("--loader", default="core", help="loader plugin: core (torch format), hf, or a module name")
    parser.add_argument("--saver", default="core", help="saver plugin: core (torch format), hf, or a module name")
    parser.add_argument("--load-dir", required=True, help="directory to load the checkpoint from")
    parser.add_argument("--save-dir", required=True, help="directory to save the checkpoint to")
    parser.add_argument("--max-queue-size", type=int, default=50, help="messages the loader may run ahead of the saver")
    parser.add_argument("--no-checking", action="store_false", dest="checking",
                        help="do not check the names and order of the messages")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # The plugins add their own flags, so --loader/--saver are read first (and --help works without the
    # required flags).
    plugins = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    plugins.add_argument("--loader", default="core")
    plugins.add_argument("--saver", default="core")
    known, _ = plugins.parse_known_args(argv)
    loader, saver = load_plugin("loader", known.loader), load_plugin("saver", known.saver)
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    parser.add_argument("-h", "--help", action="help", help="show this help (with the chosen plugins' flags)")
    args = parser.parse_args(argv)
    if args.model_type == "BERT":
        raise ValueError("--model-type BERT: convert.py converts GPT checkpoints so far; export BERT to Hugging Face "
                         "with tools/checkpoint/export_bert_hf.py")

    messages = MessageQueue(args.max_queue_size)
    saver_errors = []

    def run_saver():
        try:
            saver.save_checkpoint(messages, args)
        except BaseException as error:  # re-raised in the main thread below
            saver_errors.append(error)
        finally:
            messages.stopped.set()

    saver_thread = threading.Thread(target=run_saver, name="convert-saver")
    saver_thread.start()
    try:
        loader.load_checkpoint(messages, args)
    except SaverStopped:
        saver_thread.join()
        if saver_errors:
            raise saver_errors[0]
        raise
    except BaseException:  # the loader's own failure: the saver sees "exit" and stops
        messages.stopped.set()
        saver_thread.join()
        raise
    saver_thread.join()
    if saver_errors:
        raise saver_errors[0]
    return 0
