"""Logging once per job: dataset building runs on many ranks, its messages should print on one."""

import logging

import torch


def global_rank() -> int:
    """This process's rank in the default process group, 0 when torch.distributed is not in use."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def log_single_rank(logger: logging.Logger, level: int, message: str, rank: int = 0) -> None:
    """Logs `message` on global rank `rank` only (or always, when not distributed)."""
    if global_rank() == rank:
        logger.log(level, message)
