"""Where a torch-format checkpoint lives on disk (reference 8.1):

    <dir>/latest_checkpointed_iteration.txt        "1000" or "release"
    <dir>/iter_0001000/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
    <dir>/release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt

TT is the tensor-parallel rank (2 digits); _PPP the pipeline rank, present when PP > 1; _EEE the
expert-parallel rank, present when EP > 1 (so with PP = 1, `mp_rank_00_001` is an expert rank).

The ranks that share a file name hold the same weights (the expert-TP rank follows from the TP rank,
since ETP divides TP); the first of them in the data-parallel x context-parallel group writes it.
"""

import os

import torch
import torch.distributed as dist

from megatron.core import parallel_state

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_BASENAME = "model_optim_rng.pt"


def ensure_directory_exists(filename, check_parent=True):
    """Creates the directory of `filename` (or `filename` itself with check_parent=False)."""
    directory = os.path.dirname(filename) if check_parent else filename
    os.makedirs(directory, exist_ok=True)


def get_checkpoint_name(
    checkpoints_path,
    iteration,
    release=False,
    pipeline_parallel=None,
    tensor_rank=None,
    pipeline_rank=None,
    expert_parallel=None,
    expert_rank=None,
    return_base_dir=False,
    basename=CHECKPOINT_BASENAME,
):
    """This rank's checkpoint file (or, with return_base_dir, the iteration directory).

    Ranks and "is PP/EP > 1" default to this process's place in `parallel_state`.
    """
    directory = os.path.join(checkpoints_path, "release" if release else f"iter_{iteration:07d}")
    if return_base_dir:
        return directory
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if expert_parallel is None:
        expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = parallel_state.get_expert_model_parallel_rank()

    rank_directory = f"mp_rank_{tensor_rank:02d}"
    if pipeline_parallel:
        rank_directory += f"_{pipeline_rank:03d}"
    if expert_parallel:
        rank_directory += f"_{expert_rank:03d}"
    return os.path.join(directory, rank_directory, basename)


def writes_checkpoint_file() -> bool:
    """Whether this rank writes its `mp_rank_..` file: no rank before it in its data-parallel x
    context-parallel group (same TP and PP ranks) has its expert-parallel rank. Collective over that group.

    With ETP = TP these are Megatron-LM's writers, the expert-DP rank 0s; with ETP < TP some (TP, EP)
    pairs have no expert-DP rank 0 (TP 4, ETP 1, EP 2: ranks 2 and 3 hold TP ranks 2, 3), so the rule
    is stated over the file names instead.
    """
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return True
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    expert_rank = parallel_state.get_expert_model_parallel_rank()
    mine = torch.tensor([expert_rank], device=parallel_state.collective_device())
    expert_ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(expert_ranks, mine, group=group)
    earlier = expert_ranks[: parallel_state.get_data_parallel_rank(with_context_parallel=True)]
    return all(int(other) != expert_rank for other in earlier)


def find_checkpoint_rank_0(checkpoints_path, iteration, release=False):
    """The file of tensor/pipeline/expert rank 0, without knowing whether the run used PP or EP; None if absent."""
    for pipeline_parallel, expert_parallel in ((False, False), (False, True), (True, False), (True, True)):
        filename = get_checkpoint_name(
            checkpoints_path, iteration, release, pipeline_parallel=pipeline_parallel, tensor_rank=0,
            pipeline_rank=0, expert_parallel=expert_parallel, expert_rank=0,
        )
        if os.path.isfile(filename):
            return filename
    return None


def get_checkpoint_tracker_filename(checkpoints_path):
    """The tracker file naming the latest complete checkpoint under `checkpoints_path`."""
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def checkpoint_exists(checkpoints_path):
    """True when `checkpoints_path` holds a tracker file."""
    return checkpoints_path is not None and os.path.isfile(get_checkpoint_tracker_filename(checkpoints_path))


def _parse_tracker(tracker_filename, text):
    """(iteration, release) from the tracker's text; a ValueError naming the file otherwise."""
    if text == "release":
        return 0, True
    if text.isdigit():
        return int(text), False
    raise ValueError(
        f"checkpoint tracker {tracker_filename} is corrupt: it holds {text!r}, expected an iteration number "
        "(e.g. '1000') or 'release'. Write the iteration to load into it, or pick one with --ckpt-step"
    )


def read_metadata(tracker_filename):
    """(iteration, release) from a tracker file; the MAX iteration over all ranks when distributed.

    A release checkpoint has iteration 0. Every rank must call this when torch.distributed is initialised.
    """
    with open(tracker_filename, "r") as tracker:
        iteration, release = _parse_tracker(tracker_filename, tracker.read().strip())
    if not dist.is_initialized():
        return iteration, release
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    max_iteration = torch.tensor([iteration], dtype=torch.long, device=device)
    dist.all_reduce(max_iteration, op=dist.ReduceOp.MAX)
    if max_iteration.item() != iteration:
        # Ranks can disagree on a shared file system that has not caught up yet; the newest one wins.
        print(
            f"WARNING: on rank {dist.get_rank()} found iteration {iteration} in the metadata while max "
            f"iteration across the ranks is {max_iteration.item()}, replacing it with max iteration.",
            flush=True,
        )
    return int(max_iteration.item()), release


SUPPORTED_FORMATS = ("torch", "torch_dist")


def require_supported_format(ckpt_format) -> None:
    """Refuses checkpoint formats other than `torch` and `torch_dist` (the argument validation does too)."""
    if ckpt_format not in SUPPORTED_FORMATS:
        raise ValueError(
            f"--ckpt-format {ckpt_format} is not supported yet; use one of {', '.join(SUPPORTED_FORMATS)}"
        )


def model_parallel_position() -> str:
    """This rank's place in the layout as Megatron prints it, e.g. `[ t 1/2, p 1/1 ]` (1-based)."""
    return (
        f"[ t {parallel_state.get_tensor_model_parallel_rank() + 1}/"
        f"{parallel_state.get_tensor_model_parallel_world_size()}, "
        f"p {parallel_state.get_pipeline_model_parallel_rank() + 1}/"
        f"{parallel_state.get_pipeline_model_parallel_world_size()} ]"
    )
