"""The bad inputs of a run, second table (see bad_inputs.py, which renders both into docs/bad_inputs.md):
the checks before the model is built (megatron/training/preflight.py) and `--dry-run`, the save directory's
lock, failed and interrupted saves, resuming, datasets, preprocessing's output and the tools.
"""

import json
import os
import socket
from unittest import mock

from .bad_inputs import (
    BASE,
    BadInput,
    _checkpoint,
    _environment,
    _gpt2_files,
    _GOOD_MERGES,
    _GOOD_VOCAB,
    _open_dataset,
    _preprocess,
    _single_rank,
    _tokenizer,
    _validate,
    _write_dataset,
    run_script,
)

# BASE on a dataset instead of mock data; and without its tokenizer (NullTokenizer of 128 ids).
ON_DATA = [flag for flag in BASE if flag != "--mock-data"]
_TOKENIZER_AT = BASE.index("--tokenizer-type")
NO_TOKENIZER = BASE[:_TOKENIZER_AT] + BASE[_TOKENIZER_AT + 4:]


def _namespace(**values):
    """Saved or run arguments for check_checkpoint_args."""
    from argparse import Namespace

    defaults = dict(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1, vocab_file=None)
    return Namespace(**{**defaults, **values})


def _as_pretrain(step, *flags, base=BASE) -> None:
    """Validation, then `step(args)` (a stage of pretrain()) with the arguments set globally, as there."""
    from megatron.training import global_vars

    args = _validate(*flags, base=base)
    global_vars.set_args(args)
    try:
        step(args)
    finally:
        global_vars.unset_global_variables()


def _preflight(*flags, base=BASE) -> None:
    """The checks before the model is built."""
    from megatron.training.preflight import preflight

    _as_pretrain(preflight, *flags, base=base)


def _dry_run(*flags) -> None:
    from megatron.training.dry_run import dry_run

    _as_pretrain(dry_run, "--dry-run", *flags)


def _plain_python(*flags) -> None:
    """Validation in a process started without torchrun (no RANK / WORLD_SIZE in the environment)."""
    from megatron.training.arguments import parse_args, validate_args

    saved = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE") if name in os.environ}
    try:
        validate_args(parse_args(args_list=[*BASE, *flags]))
    finally:
        os.environ.update(saved)


def _wordpiece_dataset(scratch: str) -> str:
    """A dataset whose sidecar records a WordPiece tokenizer (as preprocess_data.py writes it)."""
    from argparse import Namespace

    from megatron.core.datasets.tokenizer_record import tokenizer_fingerprint, write_tokenizer_record

    vocab = os.path.join(scratch, "vocab.txt")
    with open(vocab, "w") as stream:
        stream.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    prefix = _write_dataset(os.path.join(scratch, "wordpiece_text_document"), largest_id=3)
    write_tokenizer_record(prefix, tokenizer_fingerprint(
        Namespace(tokenizer_type="BertWordPieceLowerCase", vocab_file=vocab), vocab_size=7))
    return prefix


def _hf_export(scratch: str) -> str:
    directory = os.path.join(scratch, "hf")
    os.makedirs(directory)
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(directory, name), "w") as stream:
            stream.write("{}")
    return directory


def _foreign_lock(scratch: str) -> str:
    """--save DIR whose lock names a live process on this host (this test's parent)."""
    from megatron.training.checkpointing.save_lock import LOCK_NAME
    from megatron.training.processes import process_start

    save = os.path.join(scratch, "ckpt")
    os.makedirs(save)
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "process_start": process_start(os.getppid()),
              "started": "2026-01-01 00:00:00", "command": "pretrain_gpt.py --save ckpt"}
    with open(os.path.join(save, LOCK_NAME), "w") as stream:
        json.dump(holder, stream)
    return save


def _lock_unchanged(scratch: str) -> None:
    with open(os.path.join(scratch, "ckpt", ".save.lock")) as stream:
        assert json.load(stream)["pid"] == os.getppid()


def _changed_dtype_byte(scratch: str) -> None:
    prefix = _write_dataset(os.path.join(scratch, "data"))
    with open(prefix + ".idx", "r+b") as stream:
        stream.seek(17)
        stream.write(bytes([4]))  # uint16 (8) -> int32 (4)
    _open_dataset(prefix)


def _failing_save(scratch: str, failure: BaseException) -> None:
    """Iteration 1 saved, then the save of iteration 2 fails inside torch.save with `failure`."""
    from megatron.training.checkpointing import save_checkpoint
    from tests.unit_tests.training.checkpointing.tiny_run import build_run, make_args

    with _single_rank():
        args = make_args("--save", scratch)
        model, optimizer, scheduler = build_run(args, seed=1)
        save_checkpoint(1, [model], optimizer, scheduler, 0.0, args=args)
        with mock.patch("megatron.training.checkpointing.files.torch.save", side_effect=failure):
            save_checkpoint(2, [model], optimizer, scheduler, 0.0, args=args)


def _previous_checkpoint_kept(scratch: str) -> None:
    with open(os.path.join(scratch, "latest_checkpointed_iteration.txt")) as stream:
        assert stream.read() == "1"
    assert not os.path.exists(os.path.join(scratch, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))


def _no_dataset_written(scratch: str) -> None:
    left = [name for name in os.listdir(scratch) if name.startswith("out")]
    assert left == [], left


def _lost_peer(scratch: str) -> None:
    """A collective of a two-rank job failing because the other rank is gone, under the entry point."""
    from megatron.training.errors import run_entry_point

    def collective():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500")

    with _environment(WORLD_SIZE="2"):
        run_entry_point(collective)


def _corrupt_gzip(scratch: str) -> None:
    corpus = os.path.join(scratch, "corpus.jsonl.gz")
    with open(corpus, "wb") as stream:
        stream.write(b'{"text": "not gzip"}\n')
    run_script("tools/preprocess_data.py", "--input", corpus, "--output-prefix", os.path.join(scratch, "out"),
               *_gpt2_files(scratch, _GOOD_VOCAB, _GOOD_MERGES), "--workers", "1")


RUN_CASES = {
    # --- command line ------------------------------------------------------------------------------------
    "negative-lr": BadInput(
        "`--lr -0.001`", lambda scratch: _validate("--lr", "-0.001"),
        "--lr -0.001 must be >= 0"),
    "tp-without-torchrun": BadInput(
        "`python pretrain_gpt.py --tensor-model-parallel-size 2` (one process, no torchrun)",
        lambda scratch: _plain_python("--tensor-model-parallel-size", "2"),
        "This is one process started without torchrun: start 2 (or a multiple) with torchrun --nproc-per-node 2"),
    "vocab-size-with-real-tokenizer": BadInput(
        "`--vocab-size 50257` beside a GPT-2 BPE tokenizer (Megatron-LM ignores it silently)",
        lambda scratch: _tokenizer(scratch, *_gpt2_files(scratch, _GOOD_VOCAB, _GOOD_MERGES), "--vocab-size", "50257"),
        "--vocab-size 50257 is only used by --tokenizer-type NullTokenizer and TikTokenizer; --tokenizer-type "
        "GPT2BPETokenizer takes its vocabulary size from its files"),
    # --- before the model is built -----------------------------------------------------------------------
    "seq-length-zero": BadInput(
        "`--seq-length 0`", lambda scratch: _preflight("--seq-length", "0"),
        "--seq-length 0 must be at least 1"),
    "warmup-longer-than-training": BadInput(
        "`--lr-warmup-iters 20` with `--train-iters 10`", lambda scratch: _preflight("--lr-warmup-iters", "20"),
        "lr warm-up (40 samples) must be >= 0 and shorter than the lr decay (20 samples)"),
    "data-path-directory": BadInput(
        "`--data-path` naming a directory",
        lambda scratch: (_write_dataset(os.path.join(scratch, "a_text_document")),
                         _preflight("--data-path", scratch, "--split", "1", base=ON_DATA)),
        "data path {scratch} is a directory; give a dataset prefix, the path of a .bin/.idx pair without the "
        "extension, e.g. {scratch}/a_text_document (it holds a_text_document)"),
    "data-path-with-extension": BadInput(
        "`--data-path PREFIX.bin`",
        lambda scratch: (_write_dataset(os.path.join(scratch, "a")),
                         _preflight("--data-path", os.path.join(scratch, "a.bin"), "--split", "1", base=ON_DATA)),
        "data path {scratch}/a.bin: give the dataset prefix without the extension: {scratch}/a"),
    "data-path-weight-misplaced": BadInput(
        "`--data-path abc P 0.5 Q` (a weight out of place)",
        lambda scratch: _preflight("--data-path", "abc", "P", "0.5", "Q", "--split", "1", base=ON_DATA),
        "--data-path abc P 0.5 Q: entry 3, '0.5', is a number where a dataset prefix belongs; give each weight "
        "before its prefix, 'W1 PREFIX1 W2 PREFIX2 ...'"),
    "split-without-data": BadInput(
        "`--split 98,2,0` of 3 documents (a validation split with no sequence)",
        lambda scratch: _preflight("--data-path", _write_dataset(os.path.join(scratch, "d")), "--split", "98,2,0",
                                   base=ON_DATA),
        "--split 98,2,0 gives the validation split 2% of the 3 documents of {scratch}/d, which rounds to none"),
    "dataset-of-another-tokenizer": BadInput(
        "GPT-2 BPE training on a dataset that preprocess_data.py made with WordPiece",
        lambda scratch: _preflight("--data-path", _wordpiece_dataset(scratch), "--split", "1",
                                   *_gpt2_files(scratch, _GOOD_VOCAB, _GOOD_MERGES),
                                   base=[flag for flag in NO_TOKENIZER if flag != "--mock-data"]),
        "was tokenized with BertWordPieceLowerCase (7 ids; vocab_file sha256 "),
    "tokenizer-file-before-model": BadInput(
        "`--vocab-file` that does not exist, caught before the model is built",
        lambda scratch: _preflight("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                   os.path.join(scratch, "nope.json"), "--merge-file", os.path.join(scratch, "m.txt"),
                                   base=NO_TOKENIZER),
        "nope.json' (needed by --tokenizer-type GPT2BPETokenizer) does not exist"),
    "save-is-a-file": BadInput(
        "`--save` naming a file",
        lambda scratch: (open(os.path.join(scratch, "f"), "w").close(),
                         _preflight("--save", os.path.join(scratch, "f"), "--save-interval", "5")),
        "--save {scratch}/f is a file; it must be a directory"),
    "save-locked": BadInput(
        "`--save DIR` while another run saves into DIR",
        lambda scratch: _preflight("--save", _foreign_lock(scratch), "--save-interval", "5"),
        "--save {scratch}/ckpt is in use by another run (pid ",
        after=_lock_unchanged),
    "load-hf-export": BadInput(
        "`--load` of a Hugging Face export",
        lambda scratch: _preflight("--load", _hf_export(scratch)),
        "{scratch}/hf is a Hugging Face model, not a Megatron checkpoint; import it first: python "
        "tools/checkpoint/convert.py --model-type GPT --loader hf --saver core --load-dir {scratch}/hf"),
    "load-a-file": BadInput(
        "`--load` of a checkpoint file",
        lambda scratch: (open(os.path.join(scratch, "model_optim_rng.pt"), "w").close(),
                         _preflight("--load", os.path.join(scratch, "model_optim_rng.pt"))),
        "model_optim_rng.pt is a file; give the checkpoint directory"),
    "dry-run-missing-data": BadInput(
        "`--dry-run` with a missing data prefix",
        lambda scratch: _preflight("--dry-run", "--data-path", os.path.join(scratch, "nope"), "--split", "1",
                                   base=ON_DATA),
        "nope.idx not found: dataset prefix"),
    "dry-run-fits-no-gpu": BadInput(
        "`--dry-run` of a model that fits no GPU (GPT-3 175B on one)",
        lambda scratch: _dry_run("--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96"),
        "GiB per GPU even with full recomputation, more than the 192 GB of the largest GPU assumed"),
    # --- checkpoints -------------------------------------------------------------------------------------
    "resume-longer-run": BadInput(
        "resuming with a larger `--train-iters` (10 -> 12)",
        lambda scratch: _checkpoint(scratch, [], ["--train-iters", "12"]),
        "the checkpoint's learning-rate decay length (--lr-decay-iters, by default --train-iters, x global batch "
        "size, or --lr-decay-samples) is 40 samples but this run's is 48 samples"),
    "tp-mismatch": BadInput(
        "`--load` of a TP=1 checkpoint at TP=2",
        lambda scratch: __import__("megatron.training.checkpointing", fromlist=["x"]).check_checkpoint_args(
            _namespace(tensor_model_parallel_size=1), _namespace(tensor_model_parallel_size=2, load="ckpt")),
        "reshard it with: python tools/checkpoint/convert.py --model-type GPT --loader core --saver core "
        "--load-dir ckpt --save-dir ckpt-tp2 --target-tensor-parallel-size 2"),
    "disk-full-during-save": BadInput(
        "a full disk while saving (torch.save's short write)",
        lambda scratch: _failing_save(scratch, RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")),
        "saving checkpoint iteration 2 to {scratch}/iter_0000002 failed: a write came up short",
        after=_previous_checkpoint_kept),
    "ctrl-c-during-save": BadInput(
        "Ctrl-C while saving",
        lambda scratch: _failing_save(scratch, KeyboardInterrupt()),
        "error: interrupted: while saving checkpoint iteration 2 to {scratch}/iter_0000002; the previous "
        "checkpoint (1, named by {scratch}/latest_checkpointed_iteration.txt) is intact",
        after=_previous_checkpoint_kept),
    "peer-rank-gone": BadInput(
        "a rank whose peer stopped (gloo: Connection closed by peer)", _lost_peer,
        "another rank stopped (its error is above) and this rank lost its connection to it"),
    # --- datasets and preprocessing ----------------------------------------------------------------------
    "idx-dtype-byte-changed": BadInput(
        "a `.idx` whose dtype byte was changed (uint16 -> int32)", _changed_dtype_byte,
        "data.idx: the header's dtype code is 4 (int32), but the sequence pointers were written for a 2-byte "
        "dtype (3=int16 or 8=uint16): the dtype byte (offset 17) was changed or the file is corrupt; valid codes: "
        "1=uint8"),
    "empty-corpus": BadInput(
        "`preprocess_data.py` of an empty corpus", lambda scratch: _preprocess(scratch, b""),
        "corpus.jsonl: no document to write: the input has no non-blank line; nothing was written",
        after=_no_dataset_written),
    "corpus-without-key": BadInput(
        "`preprocess_data.py` of a corpus whose every line lacks the `--json-keys` key",
        lambda scratch: _preprocess(scratch, b'{"body": "ab"}\n{"body": "ba"}\n'),
        "corpus.jsonl: no document to write: all 2 non-blank lines were skipped (2 missing key)",
        after=_no_dataset_written),
    "corrupt-gzip": BadInput(
        "`preprocess_data.py` of a `.gz` that is not gzip", _corrupt_gzip,
        "corpus.jsonl.gz: cannot be decompressed, the file is corrupt or not gz data",
        after=_no_dataset_written),
    "convert-without-flags": BadInput(
        "`tools/checkpoint/convert.py` without its required flags",
        lambda scratch: __import__("megatron.training.checkpointing.conversion.convert", fromlist=["x"]).main(
            ["--model-type", "GPT"]),
        "error: the following arguments are required: --load-dir, --save-dir (see "),
}
