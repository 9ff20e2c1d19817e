"""Every bad input tried against the framework, with the message it gets: ONE table that both drives the
tests (test_bad_inputs.py, one test per row) and renders docs/bad_inputs.md, so the two never drift.

    python -m tests.functional_tests.bad_inputs --write     # regenerate docs/bad_inputs.md

Each row builds its bad input under a scratch directory and makes the call a user's run would make
(argument validation, opening a dataset, building a tokenizer, loading a checkpoint, preprocessing) under
the entry points' error convention (megatron/training/errors.py): it must end the call with a non-zero
exit status, print `error: <message>` with the row's `message` in it, and no traceback; a row's `after`
check then looks at what was left on disk. The rows of bad_inputs_run.py (checks before the model is built,
saving, preprocessing's output, the tools) follow those of this file.
"""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOC = os.path.join(ROOT, "docs", "bad_inputs.md")

# The smallest GPT command line that validates (mock data, 128-token NullTokenizer).
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128"
).split()


@dataclass(frozen=True)
class BadInput:
    tried: str  # what the user did (markdown)
    attempt: Callable[[str], None]  # attempt(scratch_dir) raises
    message: str  # must appear in the error
    after: Callable[[str], None] | None = None  # after(scratch_dir) asserts what is left (nothing complete-looking)


@contextlib.contextmanager
def _environment(**variables):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _validate(*flags, world_size: int = 1, base=BASE):
    from megatron.training.arguments import parse_args, validate_args

    with _environment(WORLD_SIZE=str(world_size), RANK="0"):
        args = parse_args(args_list=[*base, *flags])
        return validate_args(args)


def _write_dataset(prefix: str, largest_id: int = 100) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for length in (5, 9, 7):
        builder.add_document(np.append(np.arange(1, length) % largest_id, largest_id), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def _open_dataset(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    IndexedDataset(prefix)


def _truncated(scratch: str, extension: str) -> None:
    prefix = _write_dataset(os.path.join(scratch, "data"))
    path = prefix + extension
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) - 7)
    _open_dataset(prefix)


def _not_an_index(scratch: str) -> None:
    prefix = _write_dataset(os.path.join(scratch, "data"))
    with open(prefix + ".idx", "wb") as file:
        file.write(b"PK\x03\x04 this is a zip, not an index" * 4)
    _open_dataset(prefix)


def _vocabulary_mismatch(scratch: str) -> None:
    from megatron.training.data_vocabulary import check_data_vocabulary

    prefix = _write_dataset(os.path.join(scratch, "gpt2_50k"), largest_id=50256)
    args = _validate("--data-path", prefix, "--split", "98,2,0",
                     base=[flag for flag in BASE if flag != "--mock-data"])
    check_data_vocabulary(args, vocab_size=128)


def _tokenizer(scratch: str, *flags) -> None:
    from megatron.core.tokenizers import build_tokenizer
    from megatron.preprocessing.tokenizer_arguments import add_tokenizer_args

    parser = argparse.ArgumentParser()
    add_tokenizer_args(parser)
    build_tokenizer(parser.parse_args(list(flags)))


def _gpt2_files(scratch: str, vocab: str | None, merges: str | None) -> list:
    flags = ["--tokenizer-type", "GPT2BPETokenizer"]
    for name, content, flag in (("vocab.json", vocab, "--vocab-file"), ("merges.txt", merges, "--merge-file")):
        path = os.path.join(scratch, name)
        if content is not None:
            with open(path, "w") as file:
                file.write(content)
        flags += [flag, path]
    return flags


_GOOD_VOCAB = json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3})
_GOOD_MERGES = "#version: 0.2\na b\n"


def _preprocess(scratch: str, lines: bytes, *flags) -> None:
    corpus = os.path.join(scratch, "corpus.jsonl")
    with open(corpus, "wb") as file:
        file.write(lines)
    vocab_flags = _gpt2_files(scratch, _GOOD_VOCAB, _GOOD_MERGES)
    run_script("tools/preprocess_data.py", "--input", corpus, "--output-prefix", os.path.join(scratch, "out"),
               *vocab_flags, "--workers", "1", *flags)


def run_script(script: str, *flags) -> None:
    """Runs a script of the repository as a user would; its stderr and exit status become this call's."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        sys.exit(result.returncode)


@contextlib.contextmanager
def _single_rank():
    """torch.distributed with one gloo rank and the parallel groups, as a training run has them."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    init_num_microbatches_calculator(0, None, 4, 4, 1)
    try:
        yield
    finally:
        destroy_num_microbatches_calculator()
        get_cuda_rng_tracker().reset()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _checkpoint(scratch: str, save_flags: list, load_flags: list, damage: Callable[[str], None] = None) -> None:
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args

    with _single_rank():
        args = make_args("--save", scratch, *save_flags)
        model, optimizer, scheduler = build_run(args, seed=1)
        save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)
        if damage is not None:
            damage(scratch)
        args = make_args("--load", scratch, *load_flags)
        model, optimizer, scheduler = build_run(args, seed=1)
        load_checkpoint([model], optimizer, scheduler, args=args)


def _truncate_checkpoint(scratch: str) -> None:
    path = os.path.join(scratch, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    with open(path, "r+b") as file:
        file.truncate(1000)


def _write_tracker(text: str) -> Callable[[str], None]:
    def damage(scratch: str) -> None:
        with open(os.path.join(scratch, "latest_checkpointed_iteration.txt"), "w") as file:
            file.write(text)

    return damage


def _entry_script_provider(task: str, provider: str, *flags, world_size: int = 1) -> None:
    """Calls `megatron.training.tasks.<task>.<provider>` with the run's arguments, as pretrain() does."""
    import importlib

    from megatron.training import global_vars

    global_vars.set_args(_validate(*flags, world_size=world_size))
    try:
        getattr(importlib.import_module(f"megatron.training.tasks.{task}"), provider)(*(
            [[1, 0, 0]] if provider == "train_valid_test_datasets_provider" else []))
    finally:
        global_vars.unset_global_variables()


def _convert_mixtral(scratch: str, *flags, shape: tuple = ()) -> None:
    """tools/checkpoint/convert.py of a Mixtral-shaped checkpoint (4 experts) saved under `scratch`."""
    from megatron.training.checkpointing.conversion.convert import main as convert
    from tests.unit_tests.training.checkpointing.conversion.gpt_models import build_model, model_args, save_model

    with _single_rank():
        args = model_args("mixtral", *shape)
        save_model(build_model(args), args, os.path.join(scratch, "megatron"))
    convert(["--model-type", "GPT", "--load-dir", os.path.join(scratch, "megatron"), "--save-dir",
             os.path.join(scratch, "out"), "--true-vocab-size", "100", *flags])


def _config_file(scratch: str, text: str) -> None:
    path = os.path.join(scratch, "run.yaml")
    with open(path, "w") as file:
        file.write(text)
    _validate("--config-file", path)


CASES = {
    # --- command line ------------------------------------------------------------------------------------
    "global-batch-not-divisible": BadInput(
        "`--global-batch-size 10 --micro-batch-size 4` on 2 ranks",
        lambda scratch: _validate("--global-batch-size", "10", "--micro-batch-size", "4", world_size=2),
        "global batch size 10 is not a multiple of micro batch size 4 x data parallel size 2 (= world size 2 / "
        "(TP 1 x PP 1 x CP 1)); nearest valid: 8 or 16"),
    "heads-not-divisible-by-tp": BadInput(
        "`--tensor-model-parallel-size 3` with 4 attention heads, on 3 ranks",
        lambda scratch: _validate("--tensor-model-parallel-size", "3", world_size=3),
        "--num-attention-heads 4 must be divisible by --tensor-model-parallel-size 3; valid TP sizes: 1, 2, 4"),
    "world-not-divisible": BadInput(
        "`--tensor-model-parallel-size 2` on 3 ranks",
        lambda scratch: _validate("--tensor-model-parallel-size", "2", world_size=3),
        "world size 3 is not divisible by TP 2 x PP 1 x CP 1 = 2; TP x PP x CP must be one of 1, 3"),
    "seq-longer-than-positions": BadInput(
        "`--seq-length 64` with `--max-position-embeddings 32`",
        lambda scratch: _validate("--seq-length", "64"),
        "--max-position-embeddings 32 must be >= --seq-length 64"),
    "fp16-and-bf16": BadInput(
        "`--fp16 --bf16` together", lambda scratch: _validate("--fp16", "--bf16"),
        "--fp16 and --bf16 are mutually exclusive"),
    "save-without-interval": BadInput(
        "`--save DIR` without `--save-interval`", lambda scratch: _validate("--save", scratch),
        "--save needs --save-interval"),
    "iters-and-samples": BadInput(
        "`--train-iters` and `--train-samples` together", lambda scratch: _validate("--train-samples", "100"),
        "give --train-iters or --train-samples, not both (got 10 and 100)"),
    "flag-typo": BadInput(
        "a misspelt flag, `--num-layer 2`", lambda scratch: _validate("--num-layer", "2"),
        "--num-layer: did you mean --num-layers?"),
    "bad-choice": BadInput(
        "`--exit-signal SIGFOO`", lambda scratch: _validate("--exit-signal", "SIGFOO"),
        "argument --exit-signal: invalid choice: 'SIGFOO'"),
    "split-not-numbers": BadInput(
        "`--split train,valid`", lambda scratch: _validate("--split", "train,valid"),
        "--split 'train,valid' must be up to three comma-separated numbers, e.g. 949,50,1"),
    "two-data-sources": BadInput(
        "`--mock-data` and `--data-path` together", lambda scratch: _validate("--data-path", "x"),
        "choose one data source: --mock-data and --data-path were both given"),
    "hidden-not-divisible-by-heads": BadInput(
        "`--hidden-size 66` with 4 heads", lambda scratch: _validate("--hidden-size", "66"),
        "--hidden-size 66 is not divisible by --num-attention-heads 4 (16.50 per head); pass --kv-channels or use a "
        "head count in 1, 2, 3, 6, 11, 22, 33, 66"),
    "unsupported-value": BadInput(
        "`--transformer-impl inference_optimized` (not built yet)",
        lambda scratch: _validate("--transformer-impl", "inference_optimized"),
        "--transformer-impl inference_optimized: is not supported yet; use --transformer-impl local"),
    "auto-resume-without-save": BadInput(
        "`--auto-resume` without `--save`", lambda scratch: _validate("--auto-resume"),
        "--auto-resume resumes from --save: give --save DIR"),
    "spiky-factor-below-one": BadInput(
        "`--check-for-spiky-loss --spiky-loss-factor 0.5`",
        lambda scratch: _validate("--check-for-spiky-loss", "--spiky-loss-factor", "0.5"),
        "--spiky-loss-factor 0.5 must be above 1"),
    "world-size-not-a-number": BadInput(
        "`WORLD_SIZE=four` in the environment",
        lambda scratch: _validate(world_size="four"),
        "environment variable WORLD_SIZE='four' is not an integer"),
    "config-file-unknown-key": BadInput(
        "`--config-file` with a misspelt key `num_layer: 2`",
        lambda scratch: _config_file(scratch, "num_layer: 2\n"),
        "unknown key 'num_layer'; did you mean 'num-layers' (--num-layers)?"),
    "config-file-not-yaml": BadInput(
        "`--config-file` that is not YAML", lambda scratch: _config_file(scratch, "num_layers: [2\n"),
        "not valid YAML"),
    # --- data --------------------------------------------------------------------------------------------
    "missing-dataset": BadInput(
        "`--data-path` naming files that do not exist",
        lambda scratch: _open_dataset(os.path.join(scratch, "nope_text_document")),
        "nope_text_document.idx not found: dataset prefix"),
    "truncated-bin": BadInput(
        "a truncated `.bin`", lambda scratch: _truncated(scratch, ".bin"),
        "does not match its index"),
    "truncated-idx": BadInput(
        "a truncated `.idx`", lambda scratch: _truncated(scratch, ".idx"),
        "data.idx: truncated or corrupt: the header announces 3 sequences and 3 documents, which need 102 bytes, "
        "but the file has 95"),
    "idx-not-an-index": BadInput(
        "a `.idx` that is some other file", _not_an_index,
        "data.idx: not a Megatron .idx file (expected the 34-byte header starting with b'MMIDIDX\\x00\\x00'"),
    "vocabulary-mismatch": BadInput(
        "data tokenized with GPT-2 (ids up to 50256) trained with a 128-id tokenizer", _vocabulary_mismatch,
        "holds token id 50256, but the tokenizer (NullTokenizer) has 128 ids: the data was tokenized with "
        "another tokenizer"),
    "blend-weight-not-positive": BadInput(
        "`--data-path 0 a 1 b` (a zero weight)",
        lambda scratch: __import__("megatron.core.datasets.blend", fromlist=["x"]).get_blend_from_list(
            ["0", "a", "1", "b"]),
        "blend weights must be positive, got 0.0 for 'a'"),
    # --- tokenizer files ---------------------------------------------------------------------------------
    "vocab-json-not-json": BadInput(
        "a GPT-2 `--vocab-file` that is not JSON",
        lambda scratch: _tokenizer(scratch, *_gpt2_files(scratch, "not json", _GOOD_MERGES)),
        "is not a readable GPT-2 vocab.json"),
    "missing-merges": BadInput(
        "`--merge-file` naming a file that does not exist",
        lambda scratch: _tokenizer(scratch, *_gpt2_files(scratch, _GOOD_VOCAB, None)),
        "merges.txt' (needed by --tokenizer-type GPT2BPETokenizer) does not exist"),
    "sentencepiece-garbage": BadInput(
        "a `--tokenizer-model` that is not a SentencePiece model",
        lambda scratch: (open(os.path.join(scratch, "t.model"), "w").write("garbage"),
                         _tokenizer(scratch, "--tokenizer-type", "SentencePieceTokenizer",
                                    "--tokenizer-model", os.path.join(scratch, "t.model"))),
        "t.model' is not a SentencePiece model"),
    "null-tokenizer-without-size": BadInput(
        "`--tokenizer-type NullTokenizer` without `--vocab-size`",
        lambda scratch: _tokenizer(scratch, "--tokenizer-type", "NullTokenizer"),
        "--vocab-size is required by --tokenizer-type NullTokenizer"),
    # --- preprocessing -----------------------------------------------------------------------------------
    "non-utf8-json": BadInput(
        "a corpus line that is not UTF-8, `preprocess_data.py --strict`",
        lambda scratch: _preprocess(scratch, b'{"text": "ab"}\n{"text": "a\xff\xfeb"}\n', "--strict"),
        "corpus.jsonl:2: invalid UTF-8: byte 11: b'\\xff\\xfeb\"' (--strict stops at the first bad line; nothing was "
        "written)"),
    "malformed-json": BadInput(
        "a corpus line that is not JSON, `--strict`",
        lambda scratch: _preprocess(scratch, b'{"text": "ab"}\n{"text": ab\n', "--strict"),
        "corpus.jsonl:2: malformed JSON: Expecting value at column 10"),
    "missing-json-key": BadInput(
        "a corpus without the `--json-keys` key, `--strict`",
        lambda scratch: _preprocess(scratch, b'{"body": "ab"}\n', "--strict"),
        "corpus.jsonl:1: missing key: no 'text' (keys: ['body'])"),
    # --- checkpoints -------------------------------------------------------------------------------------
    "checkpoint-other-shape": BadInput(
        "`--load` of a checkpoint with another model shape (hidden 32 -> 64)",
        lambda scratch: _checkpoint(scratch, [], ["--hidden-size", "64"]),
        "does not match this run's arguments:\n  - hidden_size: checkpoint 32, this run 64"),
    "checkpoint-truncated": BadInput(
        "`--load` of a truncated checkpoint file (no older one)",
        lambda scratch: _checkpoint(scratch, [], [], _truncate_checkpoint),
        "model_optim_rng.pt (1000 bytes) is corrupt or truncated and cannot be read"),
    "tracker-garbage": BadInput(
        "`latest_checkpointed_iteration.txt` holding garbage",
        lambda scratch: _checkpoint(scratch, [], [], _write_tracker("garbage")),
        "latest_checkpointed_iteration.txt is corrupt: it holds 'garbage'"),
    "ckpt-step-missing": BadInput(
        "`--ckpt-step 7` when only iteration 2 was saved",
        lambda scratch: _checkpoint(scratch, [], ["--ckpt-step", "7"]),
        "--ckpt-step 7: {scratch} has no iter_0000007; saved iterations: [2]"),
    "exit-on-missing-checkpoint": BadInput(
        "`--exit-on-missing-checkpoint` with an empty `--load` directory",
        lambda scratch: _checkpoint(scratch, [], ["--exit-on-missing-checkpoint"],
                                    lambda directory: os.remove(os.path.join(directory, "latest_checkpointed_"
                                                                                        "iteration.txt"))),
        "--exit-on-missing-checkpoint: no checkpoint to load"),
    # --- BERT, T5 and checkpoint conversion --------------------------------------------------------------
    "bert-mock-data": BadInput(
        "`pretrain_bert.py --mock-data` (BERT needs sentence-split data)",
        lambda scratch: _entry_script_provider("bert", "train_valid_test_datasets_provider"),
        "pretrain_bert.py needs sentence-split data: give --data-path PREFIX_text_sentence"),
    "bert-pipeline-parallel": BadInput(
        "`pretrain_bert.py --pipeline-model-parallel-size 2` on 2 ranks",
        lambda scratch: _entry_script_provider("bert", "model_provider", "--pipeline-model-parallel-size", "2",
                                               world_size=2),
        "--pipeline-model-parallel-size 2: pipeline parallelism is not supported yet for BERT"),
    "t5-without-decoder-length": BadInput(
        "`pretrain_t5.py` without `--decoder-seq-length`",
        lambda scratch: _entry_script_provider("t5", "model_provider"),
        "pretrain_t5.py needs --decoder-seq-length"),
    "convert-expert-parallel-not-dividing": BadInput(
        "`convert.py --target-expert-parallel-size 3` of a checkpoint with 4 experts",
        lambda scratch: _convert_mixtral(scratch, "--target-expert-parallel-size", "3"),
        "--target-expert-parallel-size 3 must divide the 4 experts: legal sizes 1, 2, 4"),
    "export-moe-with-dense-layers": BadInput(
        "`convert.py --saver hf` of a MoE model with dense layers (`--moe-layer-freq 2`)",
        lambda scratch: _convert_mixtral(scratch, "--saver", "hf", shape=("--moe-layer-freq", "2")),
        "--moe-layer-freq with dense layers (Mixtral has experts in every layer)"),
}


def error_message(case: BadInput, scratch: str) -> str:
    """What `case` prints, run as an entry point runs: `error: ...` and a non-zero exit status, no traceback.
    An error that is not a user error propagates with its traceback (and fails the test)."""
    from megatron.training.errors import run_entry_point

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            run_entry_point(case.attempt, scratch)
    except SystemExit as stopped:
        printed = stderr.getvalue()
        assert stopped.code not in (0, None), f"{case.tried}: exit status {stopped.code}\n{printed}"
        assert "error: " in printed and "Traceback" not in printed, printed
        return printed
    raise AssertionError(f"{case.tried}: no error")


def all_cases() -> dict:
    """This file's rows, then bad_inputs_run.py's."""
    from .bad_inputs_run import RUN_CASES

    return {**CASES, **RUN_CASES}


def markdown() -> str:
    rows = ["| # | Bad input | Message (excerpt that the test checks) |", "|---|---|---|"]
    for number, case in enumerate(all_cases().values(), 1):
        message = case.message.replace("{scratch}", "DIR").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| {number} | {case.tried} | `{message}` |")
    return ("# Bad inputs and the messages they get\n\n"
            "Every entry point (`pretrain_*.py`, the tools, `python -m megatron doctor`) answers a user error with "
            "one line, `error: <message>`, and a non-zero exit status (1; 2 for a command line that does not parse; "
            "130 for Ctrl-C), without a traceback, printed once per job under torchrun (then torchrun adds its own "
            "failure report); an unexpected exception keeps its traceback, and `MEGATRON_TRACEBACK=1` shows it for "
            "user errors too (`megatron/training/errors.py`).\n\n"
            "Generated from `tests/functional_tests/bad_inputs.py` and `bad_inputs_run.py` "
            "(`python -m tests.functional_tests.bad_inputs --write`); each row is a test in "
            "`tests/functional_tests/test_bad_inputs.py` of the exit status, the message, the absence of a "
            "traceback and, where files are involved, of anything complete-looking left behind.\n\n"
            + "\n".join(rows) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        with open(DOC, "w") as stream:
            stream.write(markdown())
    else:
        print(markdown())
