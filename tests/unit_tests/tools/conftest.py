"""Session fixtures for the data tools: the built-in corpus and tokenizers trained on it by our own tools, and
a guard against a test that hangs."""

import faulthandler
import os

import pytest

from .tool_loader import load_tool


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory) -> str:
    """The built-in corpus (the Python standard library as loose JSON), written by tools/build_stdlib_corpus.py."""
    path = str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
    assert load_tool("build_stdlib_corpus").main(["--output", path]) == 0
    return path


@pytest.fixture(scope="session")
def gpt2_tokenizer_files(tmp_path_factory, stdlib_corpus) -> tuple[str, str]:
    directory = str(tmp_path_factory.mktemp("gpt2"))
    args = ["--input", stdlib_corpus, "--type", "gpt2", "--vocab-size", "3000", "--output-dir", directory]
    assert load_tool("train_tokenizer").main(args) == 0
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")


@pytest.fixture(scope="session")
def wordpiece_vocab(tmp_path_factory, stdlib_corpus) -> str:
    directory = str(tmp_path_factory.mktemp("wordpiece"))
    args = ["--input", stdlib_corpus, "--type", "wordpiece", "--vocab-size", "3000", "--output-dir", directory]
    assert load_tool("train_tokenizer").main(args) == 0
    return os.path.join(directory, "vocab.txt")


@pytest.fixture
def hang_guard(request):
    """Ends this test's process after 120 s (a test here takes a few seconds), with every thread's stack on
    the real stderr: a hang in a worker pool's shutdown then fails the run, as a crashed xdist worker named
    by its test, instead of blocking CI. faulthandler's C watchdog thread fires even when the main thread is
    stuck in a join or a lock."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        stderr = os.dup(2)
    faulthandler.dump_traceback_later(120, exit=True, file=stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
    os.close(stderr)
