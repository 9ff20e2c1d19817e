"""The optimizer's part of a torch_dist checkpoint, in Megatron-Core's layout (its `sharded_state_dict` of
each optimizer), so that either framework resumes the other's optimizer state.

Model-space layouts: each state tensor is a global tensor on the key of its param (model_sharding.py), so it
reshards with the params under any TP / PP / DP layout and loads into either optimizer:

    plain optimizer (FP32Optimizer)          "optimizer": {"state": {i: {exp_avg, exp_avg_sq}, "common_step"},
                                                           (SGD and Muon: {momentum_buffer})
                                                           "param_groups": [...]}
    plain mixed precision (bf16 / fp16)      "optimizer": {"optimizer": {"state": ..., "param_groups": [...]},
    (and FSDP under --bf16)                                "fp32_from_fp16_params": [[fp32 main param, ...]]}
        keys optimizer.state.exp_avg.<param key>, optimizer.state.exp_avg_sq.<...>, optimizer.state.fp32_param.<...>
    distributed optimizer, "fully_reshardable" (--dist-ckpt-optim-fully-reshardable)
                                             "optimizer": {"optimizer": {"param_groups": [... with "step"]},
                                                           "param_state": {i: {param, exp_avg, exp_avg_sq}},
                                                           "param_state_sharding_type": "fully_reshardable"}
        keys optimizer.state.param.<param key> (the fp32 main param, also for fp32 models), exp_avg, exp_avg_sq

The distributed optimizer holds, per param, only elements [param_start, param_end) of the TP-local param
flattened; that stretch is written (and read) as flattened-range boxes of the same global tensor by its
data-parallel rank. The distributed optimizer's default layout, "dp_reshardable" (its buffers' buckets), is
optimizer_buckets.py's.

Param groups (hyper-parameters, without params) and Adam's step are common to all ranks (common state);
`saved_groups_and_step` reads them from any of these layouts, and Transformer Engine's or apex's Adam (step
in each group) as well as torch's (`common_step`). Several sub-optimizers (experts apart: a ChainedOptimizer)
are the entries {0: ..., 1: ...}.
"""

from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.fully_sharded_pieces import flat_stretch_pieces
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.model_sharding import TensorPiece, model_tensor_pieces
from megatron.core.dist_checkpointing.optimizer_buckets import DP_RESHARDABLE, bucket_sharded_state_dict
from megatron.core.dtensor_shards import local_tensor
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import _IMPLEMENTATION_KEYS, DistributedOptimizer
from megatron.core.optimizer.fully_sharded_optimizer import FullyShardedOptimizer
from megatron.core.optimizer.muon import TensorParallelMuon
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.optimizer.param_groups import reorder_saved_param_groups

FULLY_RESHARDABLE = "fully_reshardable"
PLAIN_MAIN_PARAM_KEY, DISTRIBUTED_MAIN_PARAM_KEY = "fp32_param", "param"
STATE_PREFIX = "optimizer.state."


def sub_optimizers(optimizer) -> list:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def state_keys(torch_optimizer: torch.optim.Optimizer) -> Tuple[str, ...]:
    """The per-param state tensors the inner optimizer keeps."""
    if isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        amsgrad = any(group.get("amsgrad") for group in torch_optimizer.param_groups)
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    if isinstance(torch_optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if any(group.get("momentum") for group in torch_optimizer.param_groups) else ()
    if isinstance(torch_optimizer, TensorParallelMuon):
        return ("momentum_buffer",)
    raise ValueError(f"--ckpt-format torch_dist cannot save the state of {type(torch_optimizer).__name__} yet")


def adam_step(torch_optimizer) -> int:
    steps = {int(state["step"]) for state in torch_optimizer.state.values() if "step" in state}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's params are at different steps {sorted(steps)}")
    return steps.pop() if steps else 0


def groups_without_params(torch_optimizer, step: Optional[int] = None) -> List[dict]:
    return [{**{key: value for key, value in group.items() if key != "params"},
             **({} if step is None else {"step": float(step)})} for group in torch_optimizer.param_groups]


def pieces_by_tensor(model_chunks: list) -> Dict[int, List[TensorPiece]]:
    """{id(model tensor): its pieces}, over every chunk (collective over TP)."""
    pieces_of = {}
    for chunk in model_chunks:
        for _, tensor, pieces in model_tensor_pieces(chunk):
            pieces_of[id(tensor)] = pieces
    return pieces_of


def _pieces(pieces_of: Dict[int, List[TensorPiece]], param) -> List[TensorPiece]:
    pieces = pieces_of.get(id(param))
    if pieces is None:
        raise ValueError(f"an optimizer param of shape {tuple(param.shape)} is not in the model's state dict")
    return pieces


def _whole_pieces(name: str, tensor: torch.Tensor, pieces: List[TensorPiece]) -> list:
    """`tensor` (of its param's shape) cut like the param, on the keys of `name`."""
    flat = local_tensor(tensor).detach().reshape(-1)
    return [ShardedTensor(f"{STATE_PREFIX}{name}.{piece.key}", flat[start : start + piece.data.numel()]
                          .view(piece.local_shape), piece.global_shape, piece.global_offset, piece.replica_id,
                          allow_shape_mismatch=piece.allow_shape_mismatch)
            for piece, start in pieces]


def _plain_entry(sub, pieces_of, main_key: Optional[str]) -> dict:
    """A plain optimizer's entry. `main_key`: the name the checkpoint gives fp32 main copies of bf16/fp16
    params ("fp32_param" as Megatron's plain optimizers write, "param" in a fully_reshardable one)."""
    inner = sub.optimizer
    step = adam_step(inner)
    # An FSDP optimizer's shards are their own main params, listed as those of a bf16 model's.
    own_mains = isinstance(sub, FullyShardedOptimizer) and sub.saves_main_params()
    mixed = isinstance(sub, Float16OptimizerWithFloat16Params) or own_mains
    model_of = sub._main_to_model_params() if isinstance(sub, Float16OptimizerWithFloat16Params) else {}
    state, main_params, index = {}, [], 0
    for group in inner.param_groups:
        group_mains = []
        for main in group["params"]:
            model = model_of.get(main, main)
            pieces = _pieces(pieces_of, model)
            tensors = inner.state.get(main, {})
            state[index] = {key: _whole_pieces(key, tensors.get(key, torch.zeros_like(main)), pieces)
                            for key in state_keys(inner)}
            if (model is not main or own_mains) and main_key is not None:
                group_mains.append(_whole_pieces(main_key, main, pieces))
            index += 1
        main_params.append(group_mains)
    if step:
        state["common_step"] = torch.tensor(float(step))
    optimizer_entry = {"state": state, "param_groups": groups_without_params(inner)}
    if not mixed:
        return optimizer_entry
    entry = {"optimizer": optimizer_entry, "fp32_from_fp16_params": main_params}
    if getattr(sub, "grad_scaler", None) is not None:
        entry["grad_scaler"] = sub.grad_scaler.state_dict()
    return entry


def _flat_stretch_pieces(sub: DistributedOptimizer, param, pieces: List[TensorPiece],
                         main_key: Optional[str], is_loading: bool) -> Dict[str, list]:
    """The pieces of this rank's stretch [param_start, param_end) of `param` (flattened) per state tensor;
    the main param under `main_key` (None: not at all). Saved, bf16 moments are widened to fp32 copies (on the
    CPU, not to double them on the GPU); loaded, the pieces are views of the moments, which DCP fills with
    the checkpoint's values rounded to their dtype."""
    stretch = sub.shard_ranges[param]
    tensors = sub.main_param_and_state(param)
    main = tensors.pop("param")
    tensors = {key: main.new_zeros(main.shape) if value is None else value for key, value in tensors.items()}
    if main_key is not None:
        tensors = {main_key: main, **tensors}
    sharded = {}
    for name, tensor in tensors.items():
        sharded[name] = []
        for piece, _ in flat_stretch_pieces(pieces, tensor.detach(), stretch.param_start, f"{STATE_PREFIX}{name}."):
            if not is_loading and piece.data.dtype != torch.float32:
                piece = piece.with_data(piece.data.to("cpu", torch.float32), piece.flattened_range)
            sharded[name].append(piece)
    return sharded


def _distributed_entry(sub: DistributedOptimizer, pieces_of, main_key: Optional[str], is_loading: bool) -> dict:
    """A distributed optimizer's model-space entry (fully_reshardable, or a request for a plain layout)."""
    param_state = {index: _flat_stretch_pieces(sub, param, _pieces(pieces_of, param), main_key, is_loading)
                   for index, param in enumerate(sub.model_params)}
    entry = {"optimizer": {"param_groups": groups_without_params(sub.optimizer, adam_step(sub.optimizer))},
             "param_state": param_state, "param_state_sharding_type": FULLY_RESHARDABLE}
    if sub.grad_scaler is not None:
        entry["grad_scaler"] = sub.grad_scaler.state_dict()
    return entry


def model_space_sharded_state_dict(optimizer, model_chunks: list, main_key: Optional[str] = None,
                                   is_loading: bool = False) -> dict:
    """The optimizer entry in a model-space layout (module docstring): what a plain optimizer saves, or a
    distributed one with --dist-ckpt-optim-fully-reshardable; as a load request (`is_loading`), `main_key`
    says where the checkpoint keeps the fp32 main params ("fp32_param", "param", None: nowhere, they are the
    model's)."""
    pieces_of = pieces_by_tensor(model_chunks)
    entries = []
    for sub in sub_optimizers(optimizer):
        if isinstance(sub, DistributedOptimizer):
            mixed = any(param.dtype != torch.float32 for param in sub.model_params)
            entries.append(_distributed_entry(sub, pieces_of, main_key if mixed or main_key == "param" else None,
                                              is_loading))
        else:
            entries.append(_plain_entry(sub, pieces_of, main_key))
    return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def saved_groups_and_step(entry: dict) -> Tuple[List[dict], dict]:
    """(param groups each with its "step", {"grad_scaler": ...} or {}) of one sub-optimizer's common entry, in
    any layout: plain (FP32 or mixed precision), distributed (fully_reshardable; dp_reshardable once its
    "optimizer" object is loaded in place)."""
    inner = entry.get("optimizer", entry)
    if "param_groups" not in inner:
        raise ValueError(f"the checkpoint's optimizer entry has no param groups (keys: {sorted(map(str, inner))})")
    common_step = inner.get("state", {}).get("common_step")
    groups = []
    for group in inner["param_groups"]:
        step = group.get("step", common_step if common_step is not None else 0)
        groups.append({**{key: value for key, value in group.items() if key != "params"}, "step": float(step)})
    scaler = {"grad_scaler": entry["grad_scaler"]} if entry.get("grad_scaler") is not None else {}
    return groups, scaler


def prepare_optimizer_for_load(optimizer, entries: List[dict]) -> None:
    """Restores hyper-parameters, Adam's step and the grad scaler from each sub-optimizer's common entry and
    allocates zero state tensors, which the sharded request then fills in place."""
    subs = sub_optimizers(optimizer)
    if len(entries) != len(subs):
        raise ValueError(
            f"the checkpoint holds the state of {len(entries)} optimizer(s), this run has {len(subs)} "
            "(expert-parallel params in one of the runs only?)"
        )
    for sub, entry in zip(subs, entries):
        groups, scaler = saved_groups_and_step(entry)
        if isinstance(sub, DistributedOptimizer):
            sub.load_state_dict({"optimizer": {"param_groups": groups}, **scaler})
            continue
        inner = sub.optimizer
        order = reorder_saved_param_groups(inner.param_groups, groups, match_sizes=False)
        state, param_groups, index = {}, [], 0
        for group, saved_index in zip(inner.param_groups, order):
            # How torch runs the update is this run's choice (a GPU run's fused Adam loads on a CPU).
            hyper = {key: value for key, value in groups[saved_index].items()
                     if key not in ("step", *_IMPLEMENTATION_KEYS)}
            hyper.update({key: group[key] for key in _IMPLEMENTATION_KEYS if key in group})
            ids = list(range(index, index + len(group["params"])))
            keeps_step = not isinstance(inner, TensorParallelMuon)
            for param_id, param in zip(ids, group["params"]):
                # A step tensor of its own per param (Adam increments each in place).
                step = {"step": torch.tensor(groups[saved_index]["step"])} if keeps_step else {}
                state[param_id] = {**step, **{key: torch.zeros_like(param) for key in state_keys(inner)}}
            param_groups.append({**hyper, "params": ids})
            index += len(ids)
        inner.load_state_dict({"state": state, "param_groups": param_groups})
        if hasattr(sub, "_load_grad_scaler_state"):
            sub._load_grad_scaler_state(scaler)


def optimizer_checkpoint_entry(optimizer, model_chunks: list, fully_reshardable: bool) -> Tuple[dict, Optional[str]]:
    """(the optimizer entry of a torch_dist checkpoint, the distributed optimizer's sharding type or None):
    the distributed optimizer's buckets (dp_reshardable) or, with `fully_reshardable`, its model-space
    layout; a plain optimizer's model-space layout."""
    subs = sub_optimizers(optimizer)
    if not any(isinstance(sub, DistributedOptimizer) for sub in subs):
        return model_space_sharded_state_dict(optimizer, model_chunks, PLAIN_MAIN_PARAM_KEY), None
    if fully_reshardable:
        return model_space_sharded_state_dict(optimizer, model_chunks, DISTRIBUTED_MAIN_PARAM_KEY), FULLY_RESHARDABLE
    entries = [bucket_sharded_state_dict(sub, chained_prefix(index, len(subs))) for index, sub in enumerate(subs)]
    return (entries[0] if len(entries) == 1 else dict(enumerate(entries))), DP_RESHARDABLE


def chained_prefix(index: int, count: int) -> str:
    """Megatron-Core's key prefix of sub-optimizer `index` of `count` in bucket layouts."""
    return f"chained_{index}." if count > 1 else ""


def saved_entries(entry: dict) -> List[dict]:
    """The per-sub-optimizer entries of a checkpoint's optimizer entry ({0: ..., 1: ...} when chained)."""
    if entry and all(isinstance(key, int) for key in entry):
        return [entry[key] for key in sorted(entry)]
    return [entry]
