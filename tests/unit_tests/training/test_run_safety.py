"""No run that ends "successfully" with a wrong result: the --save lock, --load of an iteration directory,
the tokenizer record of a dataset, resuming with a constant weight decay, and the run's summary line.
(The refusals themselves, with their messages, are rows of tests/functional_tests/bad_inputs_run.py.)"""

import json
import os
import socket
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from megatron.core.datasets.tokenizer_record import (
    check_dataset_tokenizer,
    same_vocabulary,
    tokenizer_fingerprint,
    write_tokenizer_record,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import run_summary
from megatron.training.checkpointing.save_lock import LOCK_NAME, acquire_save_lock, release_save_lock
from megatron.training.preflight import preflight


def _lock_holder(save_dir) -> dict:
    with open(os.path.join(save_dir, LOCK_NAME)) as stream:
        return json.load(stream)


def test_save_lock_is_held_until_released_and_reentrant(tmp_path):
    save = str(tmp_path / "ckpt")
    acquire_save_lock(save)
    assert _lock_holder(save)["pid"] == os.getpid() and _lock_holder(save)["host"] == socket.gethostname()
    acquire_save_lock(save)  # runs one after another in one process keep it
    release_save_lock(save)
    assert not os.path.exists(os.path.join(save, LOCK_NAME))


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                              "process_start": 1, "command": "pretrain_gpt.py"}))
    acquire_save_lock(str(save))
    warning = f"warning: taking over the stale lock {save / LOCK_NAME} of pid {int(dead.stdout)}"
    assert warning in capsys.readouterr().out
    assert _lock_holder(save)["pid"] == os.getpid()
    release_save_lock(str(save))


def test_lock_of_a_live_run_names_it(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "process_start": None, "command": "x"}
    (save / LOCK_NAME).write_text(json.dumps(holder))
    with pytest.raises(ValueError, match=f"is in use by another run \\(pid {os.getppid()} on host "
                                         f"{socket.gethostname()}"):
        acquire_save_lock(str(save))
    assert _lock_holder(save) == holder


def _run_args(**values):
    defaults = dict(load=None, ckpt_step=None, rank=1)  # rank 1: only the --load rewrite runs
    return Namespace(**{**defaults, **values})


def test_load_of_an_iteration_directory_loads_that_iteration(tmp_path):
    (tmp_path / "ckpt" / "iter_0000006").mkdir(parents=True)
    args = _run_args(load=str(tmp_path / "ckpt" / "iter_0000006"))
    preflight(args)
    assert (args.load, args.ckpt_step) == (str(tmp_path / "ckpt"), 6)
    with pytest.raises(ValueError, match="is iteration 6 of a checkpoint directory, but --ckpt-step is 4"):
        preflight(_run_args(load=str(tmp_path / "ckpt" / "iter_0000006"), ckpt_step=4))


def _gpt2(tmp_path, vocab: str, directory: str = "gpt2") -> Namespace:
    folder = tmp_path / directory
    folder.mkdir()
    (folder / "vocab.json").write_text(vocab)
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    return Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(folder / "vocab.json"),
                     merge_file=str(folder / "merges.txt"))


def test_tokenizer_record_compares_vocabularies_not_paths(tmp_path):
    gpt2 = tokenizer_fingerprint(_gpt2(tmp_path, '{"a": 0, "b": 1}'), vocab_size=2)
    moved = tokenizer_fingerprint(_gpt2(tmp_path, '{"a": 0, "b": 1}', "copy"))
    other = tokenizer_fingerprint(_gpt2(tmp_path, '{"b": 0, "a": 1}', "other"))
    hub = tokenizer_fingerprint(Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"))
    null = tokenizer_fingerprint(Namespace(tokenizer_type="NullTokenizer", vocab_size=2))
    assert same_vocabulary(gpt2, moved) is True and same_vocabulary(gpt2, other) is False
    assert same_vocabulary(gpt2, null) is False and same_vocabulary(null, dict(null)) is True
    assert same_vocabulary(gpt2, hub) is None  # files against a hub id: cannot tell, the data is accepted
    prefix = str(tmp_path / "data_text_document")
    check_dataset_tokenizer(prefix, other)  # no record (Megatron-LM's data): accepted
    write_tokenizer_record(prefix, gpt2)
    check_dataset_tokenizer(prefix, moved)
    with pytest.raises(ValueError, match="was tokenized with GPT2BPETokenizer \\(2 ids; merge_file sha256 "):
        check_dataset_tokenizer(prefix, other)


def _scheduler(train_samples: int, wd_style: str = "constant", end_wd: float = 0.1) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        Namespace(param_groups=[{}]), init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=80,
        lr_decay_style="cosine", start_wd=0.1, end_wd=end_wd, wd_incr_steps=train_samples, wd_incr_style=wd_style,
        use_checkpoint_opt_param_scheduler=False)


def test_resuming_a_longer_run_with_constant_weight_decay():
    """--lr-decay-iters fixed, --train-iters 10 -> 20: only the (unused) weight-decay ramp length differs."""
    _scheduler(160).load_state_dict(_scheduler(80).state_dict())
    with pytest.raises(ValueError, match="weight-decay ramp length .* is 80 samples but this run's is 160 samples"):
        _scheduler(160, "linear", 0.2).load_state_dict(_scheduler(80, "linear", 0.2).state_dict())


def test_summary_line_says_what_the_run_did(tmp_path):
    start = time.time()
    args = Namespace(load=None, save=None, curr_iteration=10, consumed_train_samples=40, seq_length=16, rank=0)
    assert run_summary.run_summary(args, start).startswith("run summary: trained 10 iterations (0 -> 10), 640 tokens")
    assert run_summary.run_summary(args, start).endswith("; started from scratch; last checkpoint: none (no --save)")

    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("10")
    # Written by this run: a file system's coarser timestamps could put the write before `start`.
    os.utime(save / "latest_checkpointed_iteration.txt", (start + 0.5, start + 0.5))
    run_summary.record_loaded_checkpoint(str(tmp_path / "old" / "iter_0000004"), 4, 16, weights_only=False)
    args = Namespace(load=str(tmp_path / "old"), save=str(save), curr_iteration=10, consumed_train_samples=40,
                     seq_length=16, rank=0)
    line = run_summary.run_summary(args, start)
    assert line.startswith("run summary: trained 6 iterations (4 -> 10), 384 tokens in 0:00:00; ")
    assert line.endswith(f"; started from checkpoint {tmp_path / 'old' / 'iter_0000004'} (iteration 4); last "
                         f"checkpoint: {save / 'iter_0000010'}")
    # A later run that loads nothing and saves nothing.
    later = time.time() + 1
    os.utime(save / "latest_checkpointed_iteration.txt", (later - 5, later - 5))
    args = Namespace(load=str(tmp_path / "empty"), save=str(save), curr_iteration=None, consumed_train_samples=0,
                     seq_length=16, rank=0)
    assert run_summary.run_summary(args, later).endswith(
        f"; started from scratch (--load {tmp_path / 'empty'} holds no checkpoint); last checkpoint: none saved by "
        f"this run in {save}")


def test_preflight_leaves_the_arguments_of_a_sample_based_run_as_given(monkeypatch):
    """The schedule check builds a scheduler, which derives --train-iters; the run's must still be unset, or
    the real scheduler would count --lr-warmup-samples in iterations."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = validate_args(parse_args(args_list=(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-samples 8 --lr-warmup-samples 4 --lr-decay-samples 8 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()))
    global_vars.set_args(args)
    try:
        preflight(args)
        assert global_vars.get_args() is args and args.train_iters is None and args.lr_decay_iters is None
    finally:
        global_vars.unset_global_variables()
