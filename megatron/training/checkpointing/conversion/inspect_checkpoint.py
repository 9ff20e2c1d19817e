"""`tools/checkpoint/inspect_checkpoint.py`: what a torch or torch_dist checkpoint holds, read on the CPU.

    python tools/checkpoint/inspect_checkpoint.py --load-dir checkpoints/gpt [--ckpt-step N] [--no-tensors]

Prints the iteration, checkpoint_version, a summary of the training arguments, the parallel layout
(which mp_rank_* files exist), and per file the model tensors (name, shape, dtype) and whether optimizer,
scheduler, RNG state and distrib_optim.pt are present. For a torch_dist directory: the common state's
iteration and arguments, the global tensors of the DCP index (name, global shape, dtype), the optimizer's
layout and state counted by kind. Works for this project's checkpoints and Megatron-LM's (the same format); needs no GPU
and builds no model.
"""

import argparse
import collections
import math
import os

from torch.distributed.checkpoint import FileSystemReader

from megatron.core.dist_checkpointing import is_distributed_checkpoint
from megatron.training.checkpointing.dist_loading import read_common_state
from megatron.training.checkpointing.files import load_checkpoint_file
from megatron.training.checkpointing.conversion.torch_checkpoint import iteration_directory, rank_files

_ARGS_SUMMARY = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "max_position_embeddings", "padded_vocab_size", "normalization", "position_embedding_type",
    "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights", "num_experts", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "expert_model_parallel_size", "tokenizer_type", "consumed_train_samples",
    "params_dtype",
)
_OTHER_STATE = ("optimizer", "opt_param_scheduler", "lr_scheduler", "rng_state", "rerun_state_machine",
                "num_floating_point_operations_so_far")


def _model_lines(model: dict) -> list[str]:
    lines = []
    for name, tensor in model.items():
        if hasattr(tensor, "shape"):
            lines.append(f"    {name:<60} {str(tuple(tensor.shape)):<16} {str(tensor.dtype).removeprefix('torch.')}")
        else:
            lines.append(f"    {name:<60} {type(tensor).__name__}")
    return lines


def _version_and_args_lines(checkpoint: dict) -> list[str]:
    lines = [f"  checkpoint_version: {checkpoint.get('checkpoint_version', 'absent (0)')}"]
    args = checkpoint.get("args")
    lines.append("  args:" if args is not None else "  args: absent")
    for name in _ARGS_SUMMARY if args is not None else ():
        if hasattr(args, name):
            lines.append(f"    {name} = {getattr(args, name)}")
    return lines


def _is_optimizer_key(key: str) -> bool:
    return key.startswith(("optimizer.", "chained_"))


def _optimizer_line(common: dict, saved: dict) -> str:
    """The optimizer's layout and its state tensors counted by kind (exp_avg x N, ...)."""
    layout = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    kinds = collections.Counter(key.split(".")[2] if key.startswith("optimizer.state.") else key.rsplit(".", 1)[1]
                                for key, entry in saved.items() if _is_optimizer_key(key) and hasattr(entry, "size"))
    counted = ", ".join(f"{kind} x {number}" for kind, number in sorted(kinds.items())) or "none"
    return f"  optimizer state{f' ({layout})' if layout else ''}: {counted}"


def _describe_distributed(directory: str, iteration: int, release: bool, tensors: bool) -> list[str]:
    """The common state and the DCP index of a torch_dist iteration directory."""
    common = read_common_state(directory)
    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    shards = sorted(name for name in os.listdir(directory) if name.endswith(".distcp"))
    legacy = ", common.pt" if os.path.isfile(os.path.join(directory, "common.pt")) else ""
    lines = [f"checkpoint {directory} (torch_dist: global tensors, loads under any parallel layout)",
             f"  iteration: {'release' if release else iteration}",
             f"  files: {len(shards)} shard file(s) ({', '.join(shards)}){legacy}, metadata.json"]
    lines += _version_and_args_lines(common)
    present = [key for key in _OTHER_STATE if key in common]
    objects = [key for key, entry in saved.items() if not hasattr(entry, "size")]
    extra_states = [key for key in objects if "._extra_state/" in key]
    listed = sorted(key for key in objects if key not in extra_states and not key.startswith("common_state/"))
    lines.append(f"  present: {', '.join(present) or 'none'}; sharded objects: {', '.join(listed) or 'none'}"
                 f" (and {len(extra_states)} _extra_state)")
    model = {key: entry for key, entry in saved.items() if hasattr(entry, "size") and not _is_optimizer_key(key)}
    count = sum(math.prod(entry.size) for entry in model.values())
    lines.append(f"  model: {len(model)} global tensors, {count:,} parameters")
    if tensors:
        lines.extend(f"    {key:<60} {str(tuple(entry.size)):<16} {str(entry.properties.dtype).removeprefix('torch.')}"
                     for key, entry in sorted(model.items()))
    lines.append(_optimizer_line(common, saved))
    return lines


def describe_checkpoint(load_dir: str, iteration: int | None = None, tensors: bool = True) -> str:
    """The report printed by the inspector (see the module docstring)."""
    directory, iteration, release = iteration_directory(load_dir, iteration, allow_distributed=True)
    if is_distributed_checkpoint(directory):
        return "\n".join(_describe_distributed(directory, iteration, release, tensors))
    first = load_checkpoint_file(rank_files(directory)[(0, 0, 0)])
    expert_parallel = getattr(first.get("args"), "expert_model_parallel_size", 1) > 1
    files = rank_files(directory, expert_parallel)
    lines = [f"checkpoint {directory}", f"  iteration: {'release' if release else iteration}",
             f"  parallel layout: {len(files)} file(s): "
             + ", ".join(os.path.basename(os.path.dirname(path)) for path in files.values())]
    lines += _version_and_args_lines(first)
    for (tensor_rank, pipeline_rank, expert_rank), path in sorted(files.items()):
        checkpoint = first if (tensor_rank, pipeline_rank, expert_rank) == (0, 0, 0) else load_checkpoint_file(path)
        present = [key for key in _OTHER_STATE if key in checkpoint]
        absent = [key for key in ("optimizer", "opt_param_scheduler", "rng_state") if key not in checkpoint]
        distributed_optimizer = os.path.isfile(os.path.join(os.path.dirname(path), "distrib_optim.pt"))
        expert = f", ep {expert_rank}" if expert_parallel else ""
        lines.append(f"  [tp {tensor_rank}, pp {pipeline_rank}{expert}] {path}")
        lines.append(f"    present: {', '.join(present) or 'none'}; absent: {', '.join(absent) or 'none'}; "
                     f"distrib_optim.pt: {'yes' if distributed_optimizer else 'no'}")
        chunks = sorted(key for key in checkpoint if key == "model" or (key.startswith("model") and key[5:].isdigit()))
        for chunk in chunks:
            model = checkpoint[chunk]
            count = sum(tensor.numel() for tensor in model.values() if hasattr(tensor, "numel"))
            lines.append(f"    {chunk}: {len(model)} entries, {count:,} parameters")
            if tensors:
                lines.extend(_model_lines(model))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show what a torch or torch_dist checkpoint holds (CPU only).")
    parser.add_argument("--load-dir", required=True, help="the checkpoint directory (holding the tracker file)")
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to inspect (default: the latest)")
    parser.add_argument("--no-tensors", action="store_false", dest="tensors", help="omit the per-tensor listing")
    options = parser.parse_args(argv)
    print(describe_checkpoint(options.load_dir, options.ckpt_step, options.tensors), flush=True)
    return 0
