"""`--ckpt-format torch_dist` saving, in Megatron-Core's layout: one directory per iteration written by all
ranks (reference 8.1).

    iter_N/metadata.json             {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    iter_N/.metadata, __{rank}_0.distcp
        common_state/shard_0_1       args, iteration, checkpoint_version, num_floating_point_operations_so_far,
                                     opt_param_scheduler, the optimizer's param groups, content_metadata
        model tensors                Megatron-Core's keys, layers stacked (model_sharding.py)
        optimizer state              model-space or bucket layout (optimizer_sharding.py, optimizer_buckets.py)
        rng_state/shard_{pp}.{tp}_{PP}.{TP}   the RNG state of each (pipeline, tensor) rank, written by
                                     data-parallel rank 0 (all DP ranks' states with --data-parallel-random-init)

`content_metadata` tells a reader how the optimizer was written (Megatron-Core's keys):
{"distrib_optim_sharding_type": "dp_reshardable" | "fully_reshardable" (distributed optimizer only),
"singleton_local_shards": False, "chained_optim_avoid_prefix": True}. The data-parallel ranks share the
writes of what they all hold unless --no-ckpt-fully-parallel-save.

The tracker names the iteration only after every rank has finished writing (a barrier, then global
rank 0 writes it). With --async-save the writing runs in the background and that step happens in
`finalize_async_save`, called before the next save and at the end of training; a run that dies before
leaves the previous checkpoint "latest".
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedObject, save
from megatron.core.dist_checkpointing.async_save import AsyncSaveRequest
from megatron.core.dist_checkpointing.fully_parallel import distribute_replica_writes
from megatron.core.dist_checkpointing.integrity import save_integrity_manifest
from megatron.core.dist_checkpointing.model_sharding import is_expert_key, model_sharded_state_dict
from megatron.core.dist_checkpointing.optimizer_sharding import FULLY_RESHARDABLE, optimizer_checkpoint_entry
from megatron.core.dist_checkpointing.serialization import split_state_dict
from megatron.training.checkpointing.latest import name_latest
from megatron.training.checkpointing.layout import get_checkpoint_name
from megatron.training.checkpointing.save_failures import explain_save_failure
from megatron.training.checkpointing.state_dict import CHECKPOINT_VERSION, model_chunks, model_state_key
from megatron.training.console import print_rank_0

_pending_save: Optional[AsyncSaveRequest] = None


def rng_state_per_expert_rank() -> bool:
    """Whether the DP ranks' RNG states differ in a way Megatron-LM's layout does not keep: expert
    parallelism gives each expert rank its own expert-parallel stream (this project then adds a DP axis)."""
    return parallel_state.get_expert_model_parallel_world_size() > 1


def rng_sharded_object(rng_state) -> ShardedObject:
    """This rank's RNG state (a list: one entry, or every DP rank's with --data-parallel-random-init) as a
    piece of the (PP, TP) grid written by data-parallel rank 0, as in Megatron-LM; with expert parallelism
    a piece of the (PP, TP, DP) grid."""
    position = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    data_parallel_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if rng_state_per_expert_rank():
        return ShardedObject("rng_state", rng_state, (*shape, parallel_state.get_data_parallel_world_size()),
                             (*position, parallel_state.get_data_parallel_rank()))
    return ShardedObject("rng_state", rng_state, shape, position, replica_id=data_parallel_rank)


def content_metadata(sharding_type: Optional[str]) -> dict:
    """Megatron-Core's `content_metadata` of the checkpoint (module docstring)."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding_type is not None:
        metadata = {"distrib_optim_sharding_type": sharding_type, **metadata}
        if sharding_type == FULLY_RESHARDABLE:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def sharded_checkpoint_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration,
                                  num_floating_point_operations_so_far) -> dict:
    """The state dict of a torch_dist checkpoint: reference 8.2's keys, with ShardedTensors for the model
    and optimizer tensors and ShardedObjects for the RNG state and `_extra_state`s. Collective over
    tensor-parallel ranks."""
    chunks = model_chunks(model)
    state_dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                  "num_floating_point_operations_so_far": num_floating_point_operations_so_far}
    for index, chunk in enumerate(chunks):
        state_dict[model_state_key(index, len(chunks))] = model_sharded_state_dict(chunk)
    sharding_type = None
    if optimizer is not None and not args.no_save_optim:
        state_dict["optimizer"], sharding_type = optimizer_checkpoint_entry(
            optimizer, chunks, getattr(args, "dist_ckpt_optim_fully_reshardable", False))
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_sharded_object(rng_state)
    state_dict["content_metadata"] = content_metadata(sharding_type)
    return state_dict


def _spread_writes(state_dict: dict) -> None:
    """Gives each piece replicated over the DP ranks (routed experts: the expert-DP ranks) to one of them;
    the distributed optimizer's own stretches are not replicated: they stay with their rank."""
    replicated = {key: value for key, value in state_dict.items() if key.startswith(("model", "optimizer"))}
    _, tensors, _ = split_state_dict(replicated)
    # A plain optimizer's state is replicated over DP like its params; the distributed optimizer's own
    # stretches and buckets (flattened or bucket keys) stay with their rank.
    tensors = [tensor for tensor in tensors
               if tensor.flattened_range is None and ".distributed." not in tensor.key]
    distribute_replica_writes([tensor for tensor in tensors if not is_expert_key(tensor.key)],
                              parallel_state.get_data_parallel_rank(with_context_parallel=True),
                              parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    distribute_replica_writes([tensor for tensor in tensors if is_expert_key(tensor.key)],
                              parallel_state.get_expert_data_parallel_rank(),
                              parallel_state.get_expert_data_parallel_world_size())


def finalize_async_save(blocking: bool = True) -> None:
    """Waits for the background save (if any) and makes it "latest" (collective: every rank calls it).

    With blocking=False nothing happens unless the write has finished on every rank.
    """
    global _pending_save
    if _pending_save is None:
        return
    if not blocking:
        done = torch.tensor([int(_pending_save.is_done())], device=parallel_state.collective_device())
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return
    request, _pending_save = _pending_save, None
    request.finalize()


def save_sharded_checkpoint(args, iteration, model, optimizer, opt_param_scheduler, rng_state,
                            num_floating_point_operations_so_far, save_dir, release=False) -> None:
    """Writes iteration `iteration` in torch_dist format under `save_dir` and, once every rank is done
    (at once, or in finalize_async_save with --async-save), names it in the tracker."""
    global _pending_save
    finalize_async_save(blocking=True)
    checkpoint_dir = get_checkpoint_name(save_dir, iteration, release=release, return_base_dir=True)
    state_dict = sharded_checkpoint_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration,
                                               num_floating_point_operations_so_far)
    if args.ckpt_fully_parallel_save:
        _spread_writes(state_dict)
    with explain_save_failure(save_dir, iteration, checkpoint_dir):
        request = save(state_dict, checkpoint_dir, async_sharded_save=bool(args.async_save))

    def make_latest():
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            if getattr(args, "verify_integrity", False):
                save_integrity_manifest(checkpoint_dir)
            name_latest(save_dir, iteration, release, getattr(args, "save_retain_interval", None))
        print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {save_dir} [ torch_dist ]")
        if dist.is_initialized():
            dist.barrier()

    if request is None:
        make_latest()
    else:
        request.add_finalize_fn(make_latest)
        _pending_save = request
