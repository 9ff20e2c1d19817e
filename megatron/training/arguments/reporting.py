"""Rank-0 printing for the argument layer.

Arguments are parsed before `torch.distributed` is initialised, so "rank 0" falls back to the `RANK`
variable that torchrun sets; without torchrun every process is rank 0.
"""

import os
import sys

import torch


def is_rank_zero() -> bool:
    """True on global rank 0 (from torch.distributed when initialised, else from the RANK variable)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.getenv("RANK", "0")) == 0


def print_rank_0(message: str) -> None:
    """Prints an informational line to stdout on rank 0 only."""
    if is_rank_zero():
        print(message, flush=True)


def warn_rank_0(message: str) -> None:
    """Prints one warning line to stderr on rank 0 only."""
    if is_rank_zero():
        print(f"WARNING: {message}", file=sys.stderr, flush=True)
