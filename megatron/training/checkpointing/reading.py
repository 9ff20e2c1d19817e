"""Which checkpoint a run resumes from, and reading its file.

The tracker names the latest complete iteration; `--ckpt-step N` picks `iter_N` instead. A directory
without a tracker means "no checkpoint": the run starts from scratch (or stops, with
--exit-on-missing-checkpoint).
"""

import os

from megatron.training.checkpointing.fallback import load_latest_intact, saved_iterations
from megatron.training.checkpointing.files import load_checkpoint_file
from megatron.training.checkpointing.layout import (
    find_checkpoint_rank_0,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    read_metadata,
)
from megatron.training.console import print_rank_0


def _checkpoint_iteration(load_dir, args):
    """(iteration, release) to load from `load_dir`, or None when there is nothing to load."""
    tracker_filename = get_checkpoint_tracker_filename(load_dir)
    ckpt_step = getattr(args, "ckpt_step", None)
    if ckpt_step is not None:
        if not os.path.isdir(get_checkpoint_name(load_dir, ckpt_step, return_base_dir=True)):
            raise FileNotFoundError(
                f"--ckpt-step {ckpt_step}: {load_dir} has no iter_{ckpt_step:07d}; saved iterations: "
                f"{saved_iterations(load_dir) or 'none'}"
            )
        return ckpt_step, False
    if os.path.isfile(tracker_filename):
        return read_metadata(tracker_filename)
    return None


def load_base_checkpoint(load_dir, args, rank0=False):
    """(state_dict, checkpoint_name, release) of this rank's file, or (None, "", False) when `load_dir`
    holds no checkpoint (a note is printed).

    With rank0, reads the file of tensor/pipeline rank 0 whatever the layout (before the parallel groups
    exist, e.g. for --use-checkpoint-args).
    """
    found = _checkpoint_iteration(load_dir, args) if load_dir is not None else None
    if found is None:
        tracker = get_checkpoint_tracker_filename(load_dir) if load_dir else "(no load directory given)"
        if args.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"--exit-on-missing-checkpoint: no checkpoint to load, {tracker} does not exist")
        if not rank0:
            print_rank_0(f"WARNING: could not find the metadata file {tracker}")
            print_rank_0("    will not load any checkpoints and will start from random")
        return None, "", False
    iteration, release = found
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if not rank0:
        where = "release checkpoint" if release else f"checkpoint at iteration {iteration}"
        print_rank_0(f" loading {where} from {load_dir}")
    # Imported here: dist_loading.py loads torch.distributed.checkpoint, which a run that loads nothing does not need.
    from megatron.training.checkpointing.dist_loading import detect_checkpoint_format, read_common_state

    if detect_checkpoint_format(base_dir, args) == "torch_dist":
        return read_common_state(base_dir), base_dir, release
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release)
    if rank0:
        checkpoint_name = find_checkpoint_rank_0(load_dir, iteration, release) or checkpoint_name
    if rank0 or release or getattr(args, "ckpt_step", None) is not None:
        return load_checkpoint_file(checkpoint_name), checkpoint_name, release
    state_dict, checkpoint_name, _ = load_latest_intact(load_dir, iteration)
    return state_dict, checkpoint_name, release
