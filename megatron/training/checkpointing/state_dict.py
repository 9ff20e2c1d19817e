"""What a torch-format checkpoint file holds (reference 8.2) and how model chunks go in and out of it.

    args                                   the run's argparse Namespace (with the consumed-sample counters)
    checkpoint_version                     3.0
    iteration                              int
    model | model0, model1, ...            one state dict per model chunk (virtual pipeline stage), with
                                           `<linear>._extra_state` (None without FP8) for each parallel
                                           linear, as Megatron-Core writes it (absent ones load as None)
    optimizer, opt_param_scheduler         unless --no-save-optim
    rng_state                              unless --no-save-rng (see rng.py)
    num_floating_point_operations_so_far   float (added by save_checkpoint)
"""

import torch

from megatron.core.dist_checkpointing.model_sharding import with_linear_extra_states
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.module import Float16Module
from megatron.training.checkpointing.files import CHECKPOINT_VERSION

# Our data-parallel wrappers (DDP, Megatron-FSDP's, FSDP2's) share _BaseDataParallel.
_WRAPPERS = (_BaseDataParallel, torch.nn.parallel.DistributedDataParallel, Float16Module)


def unwrap_model(model):
    """The bare module(s) under DDP / FSDP / Float16Module wrappers (a list for a list), as Megatron's `unwrap_model`."""
    if isinstance(model, list):
        return [unwrap_model(chunk) for chunk in model]
    while isinstance(model, _WRAPPERS):
        model = model.module
    return model


def model_chunks(model) -> list:
    """The unwrapped model chunks: `model` is one module or a list of them (one per virtual stage)."""
    return unwrap_model(model if isinstance(model, list) else [model])


def model_state_key(chunk_index: int, num_chunks: int) -> str:
    """`model` for a single chunk, `model0`, `model1`, ... for virtual pipeline stages."""
    return "model" if num_chunks == 1 else f"model{chunk_index}"


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None):
    """The checkpoint's state dict (the tensors are the live ones: nothing is copied or changed)."""
    chunks = model_chunks(model)
    state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION}
    if iteration is not None:
        state_dict["iteration"] = iteration
    for index, chunk in enumerate(chunks):
        save_state = getattr(chunk, "state_dict_for_save_checkpoint", chunk.state_dict)
        state_dict[model_state_key(index, len(chunks))] = with_linear_extra_states(chunk, save_state())
    if not args.no_save_optim:
        if optimizer is not None:
            state_dict["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not args.no_save_rng and rng_state:
        state_dict["rng_state"] = rng_state
    return state_dict


def load_model_state(model, state_dict: dict, strict: bool, checkpoint_name: str) -> None:
    """Loads every model chunk from its `model` / `modelN` entry; errors name the checkpoint file."""
    chunks = model_chunks(model)
    for index, chunk in enumerate(chunks):
        key = model_state_key(index, len(chunks))
        if key not in state_dict:
            saved = sorted(name for name in state_dict if name.startswith("model"))
            raise ValueError(
                f"checkpoint {checkpoint_name} has no {key!r} entry (it holds {saved}): it was saved with a "
                f"different number of model chunks (virtual pipeline stages) than this run's {len(chunks)}"
            )
        try:
            chunk.load_state_dict(state_dict[key], strict=strict)
        except RuntimeError as error:
            raise RuntimeError(f"checkpoint {checkpoint_name} does not fit model chunk {index}: {error}") from error
