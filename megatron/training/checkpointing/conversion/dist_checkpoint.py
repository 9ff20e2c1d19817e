"""A whole torch_dist GPT checkpoint (this project's or Megatron-LM's, any TP / PP / DP layout) as one full
state dict with torch-format names, for convert.py: every model tensor of the DCP index is read whole, and
the layers stacked under one key are split back into `decoder.layers.<l>.` names (model_sharding.py). The
optimizer, scheduler and RNG state are not read (as for torch-format checkpoints, torch_checkpoint.py).
"""

import argparse

import torch

from megatron.core.dist_checkpointing import ShardedTensor, load
from megatron.core.dist_checkpointing.model_sharding import state_dict_names
from megatron.core.dist_checkpointing.serialization import load_common_state_dict, saved_tensors
from megatron.training.checkpointing.saved_args import add_current_argument_names


def _is_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "chained_"))


def read_dist_checkpoint(directory: str) -> tuple[dict, argparse.Namespace | None]:
    """(full state dict with torch-format names, the saved args or None) of a torch_dist iteration directory."""
    common = load_common_state_dict(directory)
    add_current_argument_names(common)
    request = {key: ShardedTensor(key, torch.empty(shape, dtype=dtype), shape, (0,) * len(shape))
               for key, (shape, dtype) in saved_tensors(directory).items() if _is_model_key(key)}
    load(request, directory)
    state = {}
    for key, piece in request.items():
        state.update(state_dict_names(key, piece.data))
    return state, common.get("args")
