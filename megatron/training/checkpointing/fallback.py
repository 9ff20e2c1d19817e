"""Resuming from the latest checkpoint that is intact on every rank.

The tracker names the latest iteration whose files were all written (saving.py writes it last). A file can
still be damaged afterwards (a truncated copy, a disk error, a half-synced network file system): then every
rank tries the next older `iter_*` directory, until one loads everywhere. All ranks take the same decision
(one all-gather per candidate), so they never resume from different iterations.
"""

import os
import re

import torch
import torch.distributed as dist

from megatron.core.datasets.rank_logging import global_rank
from megatron.core.parallel_state import collective_device
from megatron.training.checkpointing.files import load_checkpoint_file
from megatron.training.checkpointing.layout import get_checkpoint_name
from megatron.training.console import print_rank_0


def saved_iterations(load_dir) -> list:
    """The iterations with an `iter_NNNNNNN` directory under `load_dir`, ascending."""
    names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
    return sorted(int(name[len("iter_"):]) for name in names if re.fullmatch(r"iter_\d{7}", name))


def _failed_ranks(failed: bool) -> list:
    if not dist.is_initialized():
        return [0] if failed else []
    flags = [torch.zeros(1, dtype=torch.int32, device=collective_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(failed)], dtype=torch.int32, device=collective_device()))
    return [rank for rank, flag in enumerate(flags) if flag.item()]


def load_latest_intact(load_dir, iteration: int):
    """(state_dict, checkpoint_name, iteration) of this rank for `iteration`, or for the newest older
    iteration that loads on every rank. Collective. Raises the first error when none does."""
    candidates = [iteration] + [older for older in reversed(saved_iterations(load_dir)) if older < iteration]
    first_error = None
    for candidate in candidates:
        checkpoint_name = get_checkpoint_name(load_dir, candidate)
        state_dict, error = None, None
        try:
            state_dict = load_checkpoint_file(checkpoint_name)
        except (ValueError, FileNotFoundError) as problem:
            error = problem
        failed = _failed_ranks(error is not None)
        if not failed:
            if candidate != iteration:
                print_rank_0(f"WARNING: resuming from iteration {candidate} instead of {iteration}, the latest intact "
                             "checkpoint")
            return state_dict, checkpoint_name, candidate
        first_error = first_error or error
        if error is not None:
            print(f"WARNING: rank {global_rank()}: checkpoint of iteration "
                  f"{candidate} failed its integrity check: {error}", flush=True)
        print_rank_0(f"WARNING: checkpoint iteration {candidate} in {load_dir} is damaged on rank(s) {failed}; "
                     "skipping it")
    if first_error is None:
        # Another rank failed on every candidate; this one has no error of its own to show.
        raise ValueError(f"no checkpoint in {load_dir} loads on every rank (tried iterations {candidates})")
    raise first_error
