"""Naming a finished checkpoint "latest", and Megatron's `--save-retain-interval`: once the tracker names
the new iteration, the checkpoint it named before is deleted unless its iteration is a multiple of the
retain interval (a symbolic link is left alone). Global rank 0 alone calls this, after every rank wrote.

    --save-interval 100 --save-retain-interval 500    keeps iter 500, 1000, ... and the latest
"""

import os
import shutil

from megatron.training.checkpointing.files import write_text_atomically
from megatron.training.checkpointing.layout import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.training.console import print_rank_0


def _tracked_iteration(tracker_filename) -> int | None:
    try:
        with open(tracker_filename) as tracker:
            text = tracker.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def name_latest(save_dir, iteration: int, release: bool, retain_interval: int | None) -> None:
    """Writes the tracker of `save_dir` (crash-safe); then applies `retain_interval` to the previous one."""
    tracker_filename = get_checkpoint_tracker_filename(save_dir)
    previous = _tracked_iteration(tracker_filename) if retain_interval else None
    write_text_atomically("release" if release else str(iteration), tracker_filename)
    if previous is None or previous == 0 or previous == iteration or previous % retain_interval == 0:
        return
    directory = get_checkpoint_name(save_dir, previous, return_base_dir=True)
    if os.path.islink(directory):
        print_rank_0(f"  keeping checkpoint of iteration {previous:7d} at {save_dir}: it is a symbolic link")
        return
    shutil.rmtree(directory, ignore_errors=True)
    print_rank_0(f"  deleted checkpoint of iteration {previous:7d} at {save_dir} (not a multiple of "
                 f"--save-retain-interval {retain_interval})")
