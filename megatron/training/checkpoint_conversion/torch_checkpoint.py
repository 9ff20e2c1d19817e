"""Whole torch-format GPT checkpoints (reference 8.1, 8.2) as one full state dict, in either direction (and
torch_dist ones, read by dist_checkpoint.py).

Reading takes every `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` of an iteration, merges the tensor-parallel
shards, the expert-parallel ranks (local -> global expert numbers, expert_sharding.py) and the pipeline
stages (local -> global layer numbers). Writing splits a full state dict for a target TP x PP x EP layout
and writes `args`, `checkpoint_version` 3.0, `iteration` and `model` per rank;
optimizer, scheduler and RNG state are not carried over (as Megatron's convert.py), so resume a
converted checkpoint with --no-load-optim --no-load-rng (or --finetune).
"""

import argparse
import copy
import itertools
import os
import re

from megatron.core.dist_checkpointing import is_distributed_checkpoint
from megatron.training.checkpoint.files import (
    CHECKPOINT_VERSION,
    load_checkpoint_file,
    save_atomically,
    write_text_atomically,
)
from megatron.training.checkpoint.layout import get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata
from megatron.training.checkpoint_conversion.dist_checkpoint import read_dist_checkpoint
from megatron.training.checkpoint_conversion.expert_sharding import (
    from_grouped_keys,
    merge_experts,
    split_experts,
    to_grouped_keys,
)
from megatron.training.checkpoint_conversion.pipeline_stages import merge_pipeline, split_pipeline
from megatron.training.checkpoint_conversion.tensor_parallel_sharding import (
    merge_tensor_parallel,
    split_tensor_parallel,
)

_RANK_DIRECTORY = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})")


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of a checkpoint's args with this project's defaults for options it did not record."""
    from megatron.training.arguments import build_parser

    args = copy.copy(args)
    for option, default in vars(build_parser().parse_args([])).items():
        if not hasattr(args, option):
            setattr(args, option, default)
    return args


def iteration_directory(load_dir: str, iteration: int | None = None,
                        allow_distributed: bool = False) -> tuple[str, int, bool]:
    """(directory, iteration, release) of the checkpoint named by the tracker, or of `iteration`; a torch_dist
    directory is refused unless `allow_distributed`."""
    if iteration is None:
        tracker = get_checkpoint_tracker_filename(load_dir)
        if not os.path.isfile(tracker):
            raise FileNotFoundError(f"--load-dir {load_dir} holds no torch-format checkpoint: {tracker} is missing")
        iteration, release = read_metadata(tracker)
    else:
        release = False
    directory = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} does not exist")
    if os.path.isfile(os.path.join(directory, "metadata.json")) and not allow_distributed:
        raise ValueError(f"{directory} is a distributed (torch_dist) checkpoint; convert.py reads --ckpt-format "
                         "torch checkpoints only: turn it into one with the training script's --ckpt-convert-format "
                         "torch --ckpt-convert-save DIR")
    return directory, iteration, release


def rank_files(directory: str, expert_parallel: bool = False) -> dict[tuple[int, int, int], str]:
    """{(tensor rank, pipeline rank, expert rank): model_optim_rng.pt path} of an iteration directory.

    A name has _PPP when PP > 1 and _EEE when EP > 1, so a name with one suffix is an expert rank when
    `expert_parallel` (the checkpoint's EP > 1), else a pipeline rank; rank (0, 0, 0) reads the same
    either way."""
    files = {}
    for name in sorted(os.listdir(directory)):
        match = _RANK_DIRECTORY.fullmatch(name)
        if match and os.path.isfile(os.path.join(directory, name, "model_optim_rng.pt")):
            suffixes = [int(number) for number in match.group(2).split("_")[1:]]
            if len(suffixes) == 1:
                suffixes = [0, suffixes[0]] if expert_parallel else [suffixes[0], 0]
            pipeline_rank, expert_rank = suffixes or [0, 0]
            files[(int(match.group(1)), pipeline_rank, expert_rank)] = os.path.join(directory, name,
                                                                                  "model_optim_rng.pt")
    if not files:
        raise FileNotFoundError(f"{directory} has no mp_rank_*/model_optim_rng.pt files")
    return files


def read_torch_checkpoint(load_dir: str, iteration: int | None = None) -> tuple[dict, argparse.Namespace, int, bool]:
    """(full GPT state dict, args with defaults filled in, iteration, release) of a torch-format checkpoint,
    or of a torch_dist one (dist_checkpoint.py)."""
    directory, iteration, release = iteration_directory(load_dir, iteration, allow_distributed=True)
    if is_distributed_checkpoint(directory):
        state, args = read_dist_checkpoint(directory)
        if args is None:
            raise ValueError(f"{directory} records no training arguments ('args'), so its shape is unknown")
        return state, _with_defaults(args), iteration, release
    first_file = rank_files(directory)[(0, 0, 0)]
    first = load_checkpoint_file(first_file)
    if "args" not in first or "model" not in first:
        names = [key for key in first if key.startswith("model")]
        raise ValueError(f"{first_file} lacks 'args' or 'model' (it has {names}); virtual-pipeline checkpoints "
                         "(model0, model1, ...) are not supported yet")
    args = _with_defaults(first["args"])
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    files = rank_files(directory, expert_parallel=ep > 1)
    missing = [rank for rank in itertools.product(range(tp), range(pp), range(ep)) if rank not in files]
    if missing:
        raise FileNotFoundError(f"{directory}: the args say TP={tp}, PP={pp}, EP={ep} but the files of (tp, pp, ep) "
                                f"ranks {missing} are missing")
    tied = not args.untie_embeddings_and_output_weights
    stages = []
    for p in range(pp):
        expert_ranks = []
        for e in range(ep):
            shards = [first["model"] if (t, p, e) == (0, 0, 0) else load_checkpoint_file(files[(t, p, e)])["model"]
                      for t in range(tp)]
            if args.moe_grouped_gemm:
                shards = [from_grouped_keys(shard) for shard in shards]
            expert_ranks.append(merge_tensor_parallel(shards, args.swiglu))
        stages.append(merge_experts(expert_ranks))
    return merge_pipeline(stages, args.num_layers, tied), args, iteration, release


def write_torch_checkpoint(save_dir: str, state: dict, args: argparse.Namespace, iteration: int, tp: int, pp: int,
                           release: bool = False, ep: int = 1) -> None:
    """Writes `state` (full, global layer and expert numbers, vocab rows already padded for `tp`) as a
    TP x PP x EP torch-format checkpoint; every file crash-safe, the tracker last."""
    args = copy.copy(args)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, tp
    args.padded_vocab_size = state["embedding.word_embeddings.weight"].shape[0]
    args.save, args.load = save_dir, save_dir
    tied = not args.untie_embeddings_and_output_weights
    for p, stage in enumerate(split_pipeline(state, pp, args.num_layers, tied)):
        expert_ranks = split_experts(stage, ep, args.num_experts) if args.num_experts else [stage]
        for e, expert_rank in enumerate(expert_ranks):
            for t, shard in enumerate(split_tensor_parallel(expert_rank, tp, args.swiglu)):
                filename = get_checkpoint_name(save_dir, iteration, release, pipeline_parallel=pp > 1, tensor_rank=t,
                                               pipeline_rank=p, expert_parallel=ep > 1, expert_rank=e)
                os.makedirs(os.path.dirname(filename), exist_ok=True)
                checkpoint = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                              "model": to_grouped_keys(shard) if args.moe_grouped_gemm else shard}
                save_atomically(checkpoint, filename)
    write_text_atomically("release" if release else str(iteration), get_checkpoint_tracker_filename(save_dir))
