"""`--ckpt-format torch_dist` loading, under any tensor/pipeline/data-parallel layout, of this project's
checkpoints and Megatron-LM's (the layout is dist_saving.py's).

`load_checkpoint` (loading.py) reads the common state like a torch-format file (iteration, args, counters,
scheduler) and hands the tensors to `load_sharded_state`: every rank asks for the pieces of the global
tensors it holds now, and DCP reads them from whichever files the saving layout wrote. Model params
and optimizer state are filled in place. The optimizer's layout comes from the checkpoint's
`content_metadata` (or its optimizer entry): model space (a plain optimizer's, or the distributed one's
fully_reshardable), which loads into either optimizer under any layout, or the distributed optimizer's
buckets (dp_reshardable), which load into the distributed optimizer under the saving TP / PP layout. The
RNG state is only restored under the layout that saved it (as in Megatron-LM): another layout draws
other random streams anyway.

Which format a checkpoint has is told by its metadata.json; either format loads whatever --ckpt-format says
(the format this run saves in), as in Megatron-LM main.
"""

import glob
import os
from typing import Callable, Tuple

from megatron.core.dist_checkpointing import is_distributed_checkpoint, load, load_common_state_dict, saved_keys
from megatron.core.dist_checkpointing.integrity import verify_integrity_manifest
from megatron.core.dist_checkpointing.model_sharding import (
    load_extra_states,
    model_sharded_state_dict,
    without_absent_extra_states,
)
from megatron.core.dist_checkpointing.optimizer_buckets import (
    DP_RESHARDABLE,
    apply_bucket_state,
    bucket_sharded_state_dict,
    check_buckets,
)
from megatron.core.dist_checkpointing.optimizer_sharding import (
    DISTRIBUTED_MAIN_PARAM_KEY,
    FULLY_RESHARDABLE,
    PLAIN_MAIN_PARAM_KEY,
    chained_prefix,
    model_space_sharded_state_dict,
    prepare_optimizer_for_load,
    saved_entries,
    sub_optimizers,
)
from megatron.core.dist_checkpointing.serialization import saved_tensor_shapes
from megatron.core.dist_checkpointing.strictness import describe, returns_mismatches
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.fully_sharded_optimizer import FullyShardedOptimizer
from megatron.training.checkpointing.dist_saving import rng_sharded_object
from megatron.training.checkpointing.saved_args import add_current_argument_names, report_unreadable_arguments
from megatron.training.checkpointing.state_dict import model_chunks, model_state_key
from megatron.training.console import print_rank_0


def _has_dcp_files(checkpoint_dir) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, ".metadata")) or bool(
        glob.glob(os.path.join(checkpoint_dir, "*.distcp"))
    )


def detect_checkpoint_format(checkpoint_dir, args) -> str:
    """"torch_dist" or "torch" for the iteration directory `checkpoint_dir`, from its files. Either loads
    whatever --ckpt-format says (which is the format this run saves in), as in Megatron-LM main."""
    found = "torch_dist" if is_distributed_checkpoint(checkpoint_dir) else "torch"
    if found == "torch" and _has_dcp_files(checkpoint_dir):
        raise ValueError(
            f"{checkpoint_dir} is an incompletely written distributed checkpoint (no metadata.json: its save was "
            "interrupted); load an earlier iteration with --ckpt-step"
        )
    wanted = getattr(args, "ckpt_format", None)
    if wanted is not None and found != wanted and not getattr(args, "auto_detect_ckpt_format", False):
        print_rank_0(f" {checkpoint_dir} is a {found} checkpoint; it is loaded as such, and this run saves in "
                     f"--ckpt-format {wanted}")
    return found


def read_common_state(checkpoint_dir) -> dict:
    """The common state of a torch_dist checkpoint: the keys of a torch-format file, without the tensors."""
    common = load_common_state_dict(checkpoint_dir)
    add_current_argument_names(common)
    report_unreadable_arguments(common, checkpoint_dir)
    return common


_LAYOUT_ARGS = ("pipeline_model_parallel_size", "tensor_model_parallel_size", "data_parallel_size",
                "expert_model_parallel_size")


def _per_expert_rank(run_args) -> bool:
    return (getattr(run_args, "expert_model_parallel_size", None) or 1) > 1


def _can_restore_rng(state_dict: dict, args) -> bool:
    """Only under the layout that saved it: the RNG grid is PP x TP (x DP with expert parallelism, whose
    ranks' states differ); --data-parallel-random-init keeps every DP rank's state, so DP must match too."""
    saved_args = state_dict.get("args")
    per_rank = (_per_expert_rank(saved_args) or _per_expert_rank(args)
                or bool(getattr(args, "data_parallel_random_init", False)))
    compared = _LAYOUT_ARGS if per_rank else _LAYOUT_ARGS[:2]
    saved = tuple(getattr(saved_args, name, None) or 1 for name in compared)
    current = tuple(getattr(args, name, None) or 1 for name in compared)
    if saved == current:
        return True
    print_rank_0(
        f" the checkpoint was saved with ({', '.join(compared)}) = {saved}, this run has {current}: the RNG state "
        "is not restored (this run's seeds are used)"
    )
    return False


def _optimizer_sharding_type(state_dict: dict, entries: list):
    """The distributed optimizer's layout the checkpoint was written in (None: a plain optimizer's)."""
    declared = (state_dict.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    return declared or entries[0].get("param_state_sharding_type")


def _optimizer_request(optimizer, chunks, state_dict: dict, checkpoint_dir) -> Tuple[dict, Callable[[dict], None]]:
    """(the optimizer's part of the load request, what to do with the loaded optimizer entry)."""
    if "optimizer" not in state_dict:
        raise ValueError(
            f"checkpoint {checkpoint_dir} has no optimizer state (was it saved with --no-save-optim?); pass "
            "--no-load-optim or --finetune to start the optimizer afresh"
        )
    entries = saved_entries(state_dict["optimizer"])
    sharding_type = _optimizer_sharding_type(state_dict, entries)
    subs = sub_optimizers(optimizer)
    if sharding_type in (None, FULLY_RESHARDABLE):
        prepare_optimizer_for_load(optimizer, entries)
        main_key = PLAIN_MAIN_PARAM_KEY if sharding_type is None else DISTRIBUTED_MAIN_PARAM_KEY
        request = model_space_sharded_state_dict(optimizer, chunks, main_key, is_loading=True)
        return request, lambda loaded_entry: None
    if sharding_type != DP_RESHARDABLE:
        raise ValueError(
            f"checkpoint {checkpoint_dir}: the distributed optimizer's '{sharding_type}' layout (older Megatron-LM) "
            f"is not supported yet; {DP_RESHARDABLE} and {FULLY_RESHARDABLE} are, or pass --no-load-optim"
        )
    if not all(isinstance(sub, DistributedOptimizer) for sub in subs) or len(subs) != len(entries):
        raise ValueError(
            f"checkpoint {checkpoint_dir} holds the distributed optimizer's state in its bucket layout "
            f"({DP_RESHARDABLE}), which loads only into the distributed optimizer under the saving layout: pass "
            "--use-distributed-optimizer, or --no-load-optim (saving with --dist-ckpt-optim-fully-reshardable "
            "gives a checkpoint that loads into either optimizer)"
        )
    shapes = saved_tensor_shapes(checkpoint_dir)
    requests = []
    for index, sub in enumerate(subs):
        prefix = chained_prefix(index, len(subs))
        check_buckets(sub, shapes, prefix)
        requests.append(bucket_sharded_state_dict(sub, prefix, fill=False))

    def apply(loaded_entry: dict):
        prepare_optimizer_for_load(optimizer, saved_entries(loaded_entry))
        for sub, request in zip(subs, requests):
            apply_bucket_state(sub, request)

    return (requests[0] if len(requests) == 1 else dict(enumerate(requests))), apply


def load_sharded_state(model, optimizer, state_dict: dict, checkpoint_dir, args, load_optimizer: bool,
                       load_rng: bool) -> bool:
    """Loads the model (and the optimizer's state with `load_optimizer`) from `checkpoint_dir` in place;
    with `load_rng`, puts the saved RNG state under state_dict["rng_state"] when this layout can use it.
    Returns whether it did. Collective."""
    if load_rng and getattr(state_dict.get("args"), "no_save_rng", False):
        raise ValueError(
            f"checkpoint {checkpoint_dir} has no RNG state (it was saved with --no-save-rng); pass --no-load-rng "
            "(or --finetune) to start from this run's seeds instead"
        )
    if args.verify_integrity:
        verify_integrity_manifest(checkpoint_dir)
    chunks = model_chunks(model)
    saved = saved_keys(checkpoint_dir)
    # An FSDP run under --bf16 loads its fp32 shards from the optimizer's main params, not the bf16 model entry.
    mains_into_model = load_optimizer and any(isinstance(sub, FullyShardedOptimizer) and sub.saves_main_params()
                                              for sub in sub_optimizers(optimizer))
    request = {model_state_key(index, len(chunks)): without_absent_extra_states(
                   model_sharded_state_dict(chunk, is_loading=True, without_fully_sharded=mains_into_model), saved)
               for index, chunk in enumerate(chunks)}
    after_load = None
    if load_optimizer:
        request["optimizer"], after_load = _optimizer_request(optimizer, chunks, state_dict, checkpoint_dir)
    restore_rng = load_rng and _can_restore_rng(state_dict, args)
    if restore_rng:
        request["rng_state"] = rng_sharded_object(None)
    strict = args.dist_ckpt_strictness
    loaded = load(request, checkpoint_dir, strict=strict)
    if returns_mismatches(strict):
        loaded, unexpected, missing = loaded
        print_rank_0(f" --dist-ckpt-strictness {strict}: keys this model has that {checkpoint_dir} lacks: "
                     f"{describe(unexpected) or 'none'}; checkpoint keys not loaded: {describe(missing) or 'none'}")
    for index, chunk in enumerate(chunks):
        load_extra_states(chunk, loaded[model_state_key(index, len(chunks))])
    if after_load is not None:
        after_load(loaded["optimizer"])
    # A non-strict load may have skipped the RNG state of this layout.
    restore_rng = restore_rng and loaded["rng_state"] is not None
    if restore_rng:
        state_dict["rng_state"] = loaded["rng_state"]
    return restore_rng
