"""Checkpoint save and load, under Megatron-LM's names (`from megatron.training.checkpointing import ...`).

Only `--ckpt-format torch` exists so far: `iter_0000100/mp_rank_00[_000]/model_optim_rng.pt` plus
`latest_checkpointed_iteration.txt`, readable by Megatron-LM and back. The implementation lives in
`megatron/training/checkpoint/`, one module per concept.
"""

from megatron.training.checkpoint.checkpoint_args import check_checkpoint_args, load_args_from_checkpoint
from megatron.training.checkpoint.files import load_checkpoint_file
from megatron.training.checkpoint.layout import (
    checkpoint_exists,
    ensure_directory_exists,
    find_checkpoint_rank_0,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    read_metadata,
)
from megatron.training.checkpoint.loading import load_checkpoint
from megatron.training.checkpoint.rng import get_rng_state
from megatron.training.checkpoint.saving import save_checkpoint
from megatron.training.checkpoint.state_dict import generate_state_dict

__all__ = [
    "check_checkpoint_args",
    "checkpoint_exists",
    "ensure_directory_exists",
    "find_checkpoint_rank_0",
    "generate_state_dict",
    "get_checkpoint_name",
    "get_checkpoint_tracker_filename",
    "get_rng_state",
    "load_args_from_checkpoint",
    "load_checkpoint",
    "load_checkpoint_file",
    "read_metadata",
    "save_checkpoint",
]
