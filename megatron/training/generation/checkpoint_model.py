"""A GPT ready to generate, rebuilt from a checkpoint alone.

The checkpoint's `args` (the training run's argparse Namespace, reference 8.2) give the model shape and
the tokenizer; the weights come from its `model` entry (torch format: only tensor- and pipeline-parallel
size 1 so far, whose one file holds the whole model) or its global tensors (torch_dist, any layout: they
are read for TP = PP = 1).
"""

import argparse
import os

import torch

from megatron.core.dist_checkpointing import is_distributed_checkpoint, load, saved_keys
from megatron.core.dist_checkpointing.model_sharding import (
    load_extra_states,
    model_sharded_state_dict,
    without_absent_extra_states,
)
from megatron.training import global_vars
from megatron.training.checkpointing.saved_args import with_current_defaults
from megatron.training.checkpointing.fallback import saved_iterations
from megatron.training.checkpointing.layout import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.training.checkpointing.reading import load_base_checkpoint
from megatron.training.checkpointing.state_dict import load_model_state
from megatron.training.tasks.gpt import model_provider
from megatron.core.tokenizers import build_tokenizer

TOKENIZER_FILE_ARGS = ("vocab_file", "merge_file", "tokenizer_model")


def resolve_device(device: str | None) -> torch.device:
    """`device` as a torch.device; None means the current GPU when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"--device {device!r} is not a device torch knows ({error}); use cpu, cuda or cuda:N"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu")
    return resolved


def _read_checkpoint(load_dir: str, ckpt_step: int | None):
    """(state dict, file name) of the rank-0 file of the checkpoint to load; clear errors when there is none."""
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"--load {load_dir}: no such directory")
    request = argparse.Namespace(ckpt_step=ckpt_step, exit_on_missing_checkpoint=False, auto_detect_ckpt_format=True)
    state_dict, checkpoint_name, _ = load_base_checkpoint(load_dir, request, rank0=True)
    if state_dict is None:
        iterations = [os.path.basename(get_checkpoint_name(load_dir, iteration, return_base_dir=True))
                      for iteration in saved_iterations(load_dir)]
        hint = (
            f"it has {', '.join(iterations)}: pick one with --ckpt-step N" if iterations
            else "point --load at the --save directory of a training run"
        )
        raise FileNotFoundError(
            f"--load {load_dir} holds no checkpoint: {get_checkpoint_tracker_filename(load_dir)} does not exist; {hint}"
        )
    return state_dict, checkpoint_name


def _checkpoint_args(state_dict: dict, checkpoint_name: str, sharded: bool) -> argparse.Namespace:
    """The training arguments stored in the checkpoint, with this project's defaults for any it lacks
    (checkpoints of other Megatron-LM versions record a different set); a torch-format checkpoint is checked
    for TP = PP = 1, a sharded one is read for TP = PP = 1."""
    if "args" not in state_dict:
        raise ValueError(f"{checkpoint_name} records no training arguments ('args'), so the model cannot be rebuilt")
    args = with_current_defaults(state_dict["args"])
    tensor_parallel = args.tensor_model_parallel_size
    pipeline_parallel = args.pipeline_model_parallel_size
    if sharded:
        args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    elif tensor_parallel != 1 or pipeline_parallel != 1:
        raise ValueError(
            f"{checkpoint_name} was saved with tensor_model_parallel_size={tensor_parallel}, "
            f"pipeline_model_parallel_size={pipeline_parallel}: text generation loads TP=1 only for now "
            "(and PP=1); reshard the checkpoint to TP=1, PP=1 first"
        )
    return args


def _build_tokenizer(args: argparse.Namespace, checkpoint_name: str):
    try:
        return build_tokenizer(args)
    except ValueError as error:
        raise ValueError(
            f"{error}\nThe tokenizer is the one recorded in {checkpoint_name} (--tokenizer-type "
            f"{args.tokenizer_type}); if its files moved, give their new paths with --vocab-file, --merge-file "
            "or --tokenizer-model"
        ) from None


def _load_sharded_weights(model, checkpoint_dir: str) -> None:
    """The model's weights from a torch_dist checkpoint's global tensors (this process alone)."""
    request = without_absent_extra_states(model_sharded_state_dict(model), saved_keys(checkpoint_dir))
    load_extra_states(model, load({"model": request}, checkpoint_dir)["model"])


def load_model_for_inference(
    load_dir: str,
    ckpt_step: int | None = None,
    tokenizer_files: dict | None = None,
    device: str | None = None,
):
    """(model in eval mode on `device`, tokenizer, args) from the checkpoint under `load_dir`.

    The latest checkpoint (tracker file) unless `ckpt_step` names an iteration. `tokenizer_files` maps
    `vocab_file` / `merge_file` / `tokenizer_model` to paths that replace the recorded ones. The weights
    keep the dtype they were trained in. The model is built from the checkpoint's arguments, which, with the
    tokenizer, also become the run-wide ones (`get_args()`, `get_tokenizer()`) as for a training run, for
    code written against Megatron-LM.
    """
    device = resolve_device(device)
    state_dict, checkpoint_name = _read_checkpoint(load_dir, ckpt_step)
    sharded = is_distributed_checkpoint(checkpoint_name)
    args = _checkpoint_args(state_dict, checkpoint_name, sharded)
    for name, path in (tokenizer_files or {}).items():
        if name not in TOKENIZER_FILE_ARGS:
            raise ValueError(f"unknown tokenizer file {name!r}; expected one of {', '.join(TOKENIZER_FILE_ARGS)}")
        if path is not None:
            setattr(args, name, path)
    tokenizer = _build_tokenizer(args, checkpoint_name)

    # Every weight comes from the checkpoint: skip the random initialisation, build where the model will run.
    args.perform_initialization = False
    args.use_cpu_initialization = device.type != "cuda"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    global_vars.set_args(args)
    global_vars.set_tokenizer(tokenizer)
    model = model_provider.bind(args)()
    if sharded:
        _load_sharded_weights(model, checkpoint_name)
    else:
        load_model_state(model, state_dict, strict=True, checkpoint_name=checkpoint_name)
    print(f" loaded {checkpoint_name} onto {device}", flush=True)
    return model.to(device).eval(), tokenizer, args
