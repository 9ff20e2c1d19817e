"""Checks run before the model is built, and by `--dry-run`: everything the command line and the files on
disk can tell, so that a run fails in seconds with every problem listed instead of after building the model
or its datasets.

    lengths     --seq-length (and --decoder-seq-length) positive
    schedule    the learning-rate schedule the run will build is valid (warm-up shorter than the decay)
    tokenizer   the tokenizer flags and files (megatron/core/tokenizers/build.py)
    data        each --data-path / per-split prefix names a .bin/.idx pair that opens (a directory, a path with
                its extension, a weight out of place get their own message); each split of --split holds data;
                a dataset made with another tokenizer is refused (megatron/core/datasets/tokenizer_record.py)
    --save      a directory that can be written; then locked for this run (checkpointing/save_lock.py)
    --load      an iter_N directory is read as `--load <its parent> --ckpt-step N`; a Hugging Face model
                is refused with the command that imports it; a checkpoint file with the directory to give

The checks that read files run on global rank 0 only: the other ranks go on to torch.distributed's start,
where they wait for rank 0, and torchrun stops them when rank 0 exits with the error. The `--load`
rewrite changes the arguments, so it runs on every rank.
"""

import os
import re
from types import SimpleNamespace

import numpy as np

from megatron.core.datasets.blend import get_blend_from_list
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.split import (
    Split,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
    split_ranges,
)
from megatron.core.datasets.tokenizer_record import check_dataset_tokenizer, tokenizer_fingerprint
from megatron.core.tokenizers.build import tokenizer_problems
from megatron.training.batch_plan import BatchPlan
from megatron.training.checkpointing.layout import TRACKER_FILENAME
from megatron.training.checkpointing.save_lock import acquire_save_lock
from megatron.training.datasets.blend import get_blend_and_blend_per_split
from megatron.training.train_schedule import TrainingSchedule

_ITERATION_DIRECTORY = re.compile(r"iter_(\d{7})")
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_SPLIT_NAMES = {Split.train: "training", Split.valid: "validation", Split.test: "test"}


def preflight(args) -> None:
    """Runs the checks of the module docstring on validated `args`; raises one ValueError listing every
    problem. Locks --save for the run unless this is a dry run."""
    _resolve_load(args)
    if getattr(args, "rank", 0) != 0:
        return
    problems = []
    _check_lengths(args, problems)
    _check_schedule(args, problems)
    tokenizer = tokenizer_problems(args)
    problems.extend(tokenizer)
    _check_data(args, problems, run_tokenizer=None if tokenizer else tokenizer_fingerprint(args))
    _check_load(args, problems)
    if args.save is not None:
        _check_save(args.save, problems)
    if problems:
        raise ValueError(f"{len(problems)} problem(s) found before building the model:\n  - " + "\n  - ".join(problems))
    if args.save is not None and not args.dry_run:
        acquire_save_lock(args.save)


def _check_lengths(args, problems) -> None:
    for flag, value in (("--seq-length", args.seq_length), ("--decoder-seq-length", args.decoder_seq_length)):
        if value is not None and value < 1:
            problems.append(f"{flag} {value} must be at least 1")


def _check_schedule(args, problems) -> None:
    """Builds the run's learning-rate scheduler over a stand-in optimizer: its own validation, early."""
    if args.skip_train:
        return
    try:
        schedule = TrainingSchedule.from_args(args, BatchPlan.from_args(args))
        schedule.build_scheduler(SimpleNamespace(param_groups=[{}]), args)
    except ValueError as error:
        problems.append(str(error))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _blend_lists(args) -> list:
    """(flag, list of entries) for each data flag given."""
    lists = []
    if args.data_path is not None:
        lists.append(("--data-path", args.data_path))
    for flag, paths in (("--train-data-path", args.train_data_path), ("--valid-data-path", args.valid_data_path),
                        ("--test-data-path", args.test_data_path)):
        if paths is not None:
            lists.append((flag, paths))
    return lists


def _misplaced_weight(flag: str, entries: list) -> str | None:
    """A weighted list whose weights are not where they belong reads as prefixes, some of them numbers."""
    if get_blend_from_list(entries)[1] is not None:
        return None
    numbers = [(position, entry) for position, entry in enumerate(entries, 1) if _is_number(entry)]
    if not numbers:
        return None
    position, entry = numbers[0]
    return (f"{flag} {' '.join(entries)}: entry {position}, {entry!r}, is a number where a dataset prefix belongs; "
            f"give each weight before its prefix, 'W1 PREFIX1 W2 PREFIX2 ...' (e.g. 0.3 a_text_document 0.7 "
            f"b_text_document), or prefixes only")


def _prefix_problem(prefix: str) -> str | None:
    """What is wrong with `prefix` as a dataset prefix when its .bin/.idx pair is not there, else None."""
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return None
    if os.path.isdir(prefix):
        found = sorted(name[:-4] for name in os.listdir(prefix) if name.endswith(".idx"))
        example = os.path.join(prefix, found[0] if found else "my-gpt2_text_document")
        holds = f"it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}" if found else "no .idx file there"
        return (f"data path {prefix} is a directory; give a dataset prefix, the path of a .bin/.idx pair without "
                f"the extension, e.g. {example} ({holds})")
    stem, extension = os.path.splitext(prefix)
    if extension in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        return f"data path {prefix}: give the dataset prefix without the extension: {stem}"
    for suffix in ("_text_document", "_text_sentence"):
        if os.path.isfile(prefix + suffix + ".idx"):
            return (f"data path {prefix}: no {prefix}.idx; did you mean {prefix}{suffix} (the name "
                    "preprocess_data.py wrote)?")
    return None


def _check_data(args, problems, run_tokenizer: dict | None) -> None:
    if args.mock_data:
        return
    for flag, entries in _blend_lists(args):
        problem = _misplaced_weight(flag, entries)
        if problem is not None:
            problems.append(problem)
            return
    try:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    except ValueError as error:
        problems.append(str(error))
        return
    blends = [blend] if blend is not None else [split for split in blend_per_split or [] if split is not None]
    for prefix in dict.fromkeys(prefix for prefixes, _ in blends for prefix in prefixes):
        problem = _prefix_problem(prefix)
        if problem is not None:
            problems.append(problem)
            continue
        try:
            dataset = IndexedDataset(prefix)
            if run_tokenizer is not None:
                check_dataset_tokenizer(prefix, run_tokenizer)
        except (OSError, ValueError) as error:
            problems.append(str(error))
            continue
        if blend is not None and args.split is not None:
            problems.extend(_empty_splits(prefix, dataset, args.split))


def _empty_splits(prefix: str, dataset: IndexedDataset, split: str) -> list[str]:
    """The splits of --split that get no data from `prefix` (the dataset builder stops on them later).

    A GPT split is a range of sequences and needs 2 tokens; a BERT/T5 split a range of documents. A split
    is reported when both ranges are empty, so neither kind of model could use it."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    sequences, documents = dataset.index.sequence_count, dataset.index.document_count - 1
    problems = []
    by_sequence, by_document = split_ranges(matrix, sequences), split_ranges(matrix, documents)
    for kind, sequence_range, document_range in zip(Split, by_sequence, by_document):
        if sequence_range is None:
            continue
        tokens = int(np.sum(dataset.index.sequence_lengths[sequence_range[0]:sequence_range[1]], dtype=np.int64))
        if tokens < 2 and document_range[0] == document_range[1]:
            share = 100 * (matrix[kind.value][1] - matrix[kind.value][0])
            problems.append(
                f"--split {split} gives the {_SPLIT_NAMES[kind]} split {share:.3g}% of the {documents} documents "
                f"of {prefix}, which rounds to none: give it a larger share, use more data, or give it 0 to go "
                "without it"
            )
    return problems


def _resolve_load(args) -> None:
    """--load DIR/iter_0000006 -> --load DIR --ckpt-step 6 (Megatron-LM would start from random weights)."""
    load = args.load
    if load is None or not os.path.isdir(load):
        return
    match = _ITERATION_DIRECTORY.fullmatch(os.path.basename(os.path.normpath(load)))
    if match is None or os.path.isfile(os.path.join(load, TRACKER_FILENAME)):
        return
    iteration = int(match.group(1))
    if args.ckpt_step is not None and args.ckpt_step != iteration:
        raise ValueError(f"--load {load} is iteration {iteration} of a checkpoint directory, but --ckpt-step is "
                         f"{args.ckpt_step}: give --load {os.path.dirname(os.path.normpath(load))} --ckpt-step N")
    args.load, args.ckpt_step = os.path.dirname(os.path.normpath(load)), iteration
    if getattr(args, "rank", 0) == 0:
        print(f"note: --load {load} is one iteration of {args.load}: loading it as --load {args.load} "
              f"--ckpt-step {iteration}", flush=True)


def _check_load(args, problems) -> None:
    load = args.load
    if load is None:
        return
    if os.path.isfile(load):
        directory = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(load))))
        problems.append(f"--load {load} is a file; give the checkpoint directory (the --save of the run that wrote "
                        f"it, holding {TRACKER_FILENAME}), e.g. --load {directory}")
    elif (os.path.isdir(load) and not os.path.isfile(os.path.join(load, TRACKER_FILENAME))
          and os.path.isfile(os.path.join(load, "config.json"))
          and any(os.path.isfile(os.path.join(load, name)) for name in _HF_WEIGHTS)):
        target = f" --target-tensor-parallel-size {args.tensor_model_parallel_size}" \
            if args.tensor_model_parallel_size > 1 else ""
        problems.append(
            f"--load {load} is a Hugging Face model, not a Megatron checkpoint; import it first: python "
            f"tools/checkpoint/convert.py --model-type GPT --loader hf --saver core --load-dir {load} "
            f"--save-dir {os.path.normpath(load)}-megatron{target}, then --load {os.path.normpath(load)}-megatron"
        )


def _check_save(save: str, problems) -> None:
    if os.path.exists(save) and not os.path.isdir(save):
        problems.append(f"--save {save} is a file; it must be a directory (created when missing)")
        return
    existing = os.path.abspath(save)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        problems.append(f"--save {save} cannot be created: {existing} is a file, not a directory")
    elif not os.access(existing, os.W_OK | os.X_OK):
        problems.append(f"--save {save} is not writable: this user cannot create files in {existing}")
