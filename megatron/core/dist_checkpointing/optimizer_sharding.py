"""Optimizer state as ShardedTensors on the keys of the params it belongs to, so that it reshards with them.

    optimizer.state.exp_avg.<param key>      Adam's moments (SGD: momentum_buffer), the param's global shape
    optimizer.state.exp_avg_sq.<param key>
    optimizer.state.fp32_param.<param key>   the fp32 main copy of a bf16/fp16 param

A plain optimizer holds each moment whole (like its param: the same pieces, the same replicas). The
distributed optimizer holds, per param, only elements [param_start, param_end) of the TP-local param
flattened (distrib_optimizer.py); that stretch becomes a flattened-range piece of the same global
tensor, written by this data-parallel rank alone. Either way the checkpoint holds global tensors, so
it loads onto any TP/PP/DP layout and onto either optimizer.

What is the same on every rank goes to common.pt, one entry per (chained) sub-optimizer:
{"param_groups": hyper-parameters and Adam's step, without params; "grad_scaler": ...}.
"""

from typing import Dict, List, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.model_sharding import TensorPiece, model_tensor_pieces
from megatron.core.optimizer.chained_optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import _IMPLEMENTATION_KEYS, DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.optimizer.param_groups import reorder_saved_param_groups

MAIN_PARAM_KEY = "fp32_param"


def _sub_optimizers(optimizer) -> list:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _state_keys(torch_optimizer: torch.optim.Optimizer) -> Tuple[str, ...]:
    """The per-param state tensors the inner optimizer keeps."""
    if isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        amsgrad = any(group.get("amsgrad") for group in torch_optimizer.param_groups)
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    if isinstance(torch_optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if any(group.get("momentum") for group in torch_optimizer.param_groups) else ()
    raise ValueError(f"--ckpt-format torch_dist cannot save the state of {type(torch_optimizer).__name__} yet")


def _adam_step(torch_optimizer) -> int:
    steps = {int(state["step"]) for state in torch_optimizer.state.values() if "step" in state}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's params are at different steps {sorted(steps)}")
    return steps.pop() if steps else 0


def optimizer_common_state(optimizer) -> List[dict]:
    """What every rank has alike, one dict per sub-optimizer (see the module docstring)."""
    common = []
    for sub in _sub_optimizers(optimizer):
        step = _adam_step(sub.optimizer)
        groups = [{**{key: value for key, value in group.items() if key != "params"}, "step": step}
                  for group in sub.optimizer.param_groups]
        entry = {"param_groups": groups}
        if getattr(sub, "grad_scaler", None) is not None:
            entry["grad_scaler"] = sub.grad_scaler.state_dict()
        common.append(entry)
    return common


def prepare_optimizer_for_load(optimizer, common: List[dict]) -> None:
    """Restores hyper-parameters, step and grad scaler from `common` and allocates zero state tensors,
    which `optimizer_sharded_state_dict` then hands to the loader to fill."""
    subs = _sub_optimizers(optimizer)
    if len(common) != len(subs):
        raise ValueError(
            f"the checkpoint holds the state of {len(common)} optimizer(s), this run has {len(subs)} "
            "(expert-parallel params in one of the runs only?)"
        )
    for sub, saved in zip(subs, common):
        if isinstance(sub, DistributedOptimizer):
            sub.load_state_dict({"optimizer": {"param_groups": saved["param_groups"]}, **_scaler(saved)})
            continue
        inner = sub.optimizer
        order = reorder_saved_param_groups(inner.param_groups, saved["param_groups"], match_sizes=False)
        state, groups, index = {}, [], 0
        for group, saved_index in zip(inner.param_groups, order):
            # How torch runs the update is this run's choice (a GPU run's fused Adam loads on a CPU).
            hyper = {key: value for key, value in saved["param_groups"][saved_index].items()
                     if key not in ("step", *_IMPLEMENTATION_KEYS)}
            hyper.update({key: group[key] for key in _IMPLEMENTATION_KEYS if key in group})
            step = float(saved["param_groups"][saved_index]["step"])
            ids = list(range(index, index + len(group["params"])))
            for param_id, param in zip(ids, group["params"]):
                state[param_id] = {"step": torch.tensor(step),
                                   **{key: torch.zeros_like(param) for key in _state_keys(inner)}}
            groups.append({**hyper, "params": ids})
            index += len(ids)
        inner.load_state_dict({"state": state, "param_groups": groups})
        if hasattr(sub, "_load_grad_scaler_state"):
            sub._load_grad_scaler_state(saved)


def _scaler(saved: dict) -> dict:
    return {"grad_scaler": saved["grad_scaler"]} if "grad_scaler" in saved else {}


def _whole_param_tensors(sub) -> List[Tuple[torch.nn.Parameter, Dict[str, torch.Tensor]]]:
    """(model param, {state name: tensor of the param's shape}) for a plain optimizer; the fp32 main copy
    of a bf16/fp16 param is one of them."""
    inner = sub.optimizer
    if isinstance(sub, Float16OptimizerWithFloat16Params):
        groups = zip(sub.float16_groups, sub.fp32_from_float16_groups)
        pairs = [(model, main, True)
                 for model_group, main_group in groups for model, main in zip(model_group, main_group)]
        pairs += [(param, param, False) for group in sub.fp32_from_fp32_groups for param in group]
    else:
        pairs = [(param, param, False) for group in inner.param_groups for param in group["params"]]
    result = []
    for model_param, main_param, distinct in pairs:
        state = inner.state.get(main_param, {})
        tensors = {key: state.get(key, torch.zeros_like(main_param)) for key in _state_keys(inner)}
        if distinct:
            tensors[MAIN_PARAM_KEY] = main_param
        result.append((model_param, tensors))
    return result


def _whole_param_pieces(tensors: Dict[str, torch.Tensor], pieces: List[TensorPiece]) -> Dict[str, list]:
    sharded = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().reshape(-1)
        sharded[name] = [
            piece.with_data(flat[start : start + piece.data.numel()].view(piece.local_shape))
            for piece, start in pieces
        ]
    return sharded


def _flat_stretch_pieces(sub: DistributedOptimizer, param, pieces: List[TensorPiece]) -> Dict[str, list]:
    """The pieces of this rank's stretch [param_start, param_end) of `param` (flattened) per state tensor."""
    stretch = sub.shard_ranges[param]
    tensors = sub.main_param_and_state(param)
    main = tensors.pop("param")
    tensors = {key: main.new_zeros(main.shape) if value is None else value for key, value in tensors.items()}
    if param.dtype != torch.float32:
        tensors[MAIN_PARAM_KEY] = main
    sharded = {name: [] for name in tensors}
    for piece, start in pieces:
        low, high = max(stretch.param_start, start), min(stretch.param_end, start + piece.data.numel())
        if low >= high:
            continue
        # Each DP rank owns its stretch: no replicas over DP.
        replica_id = (*piece.replica_id[:-1], 0) if isinstance(piece.replica_id, tuple) else piece.replica_id
        for name, tensor in tensors.items():
            data = tensor.detach()[low - stretch.param_start : high - stretch.param_start]
            sharded[name].append(ShardedTensor(
                piece.key, data, piece.global_shape, piece.global_offset, replica_id, piece.local_shape,
                slice(low - start, high - start), piece.allow_shape_mismatch,
            ))
    return sharded


def optimizer_sharded_state_dict(optimizer, model_chunks: list, prefix: str = "optimizer.state.") -> Dict[str, list]:
    """{"optimizer.state.<name>.<param key>": [ShardedTensor, ...]} of `optimizer`'s live state tensors
    (see the module docstring). Collective over the tensor-parallel group. Call `prepare_optimizer_for_load`
    first when loading."""
    pieces_of: Dict[int, List[TensorPiece]] = {}
    for chunk in model_chunks:
        for _, tensor, pieces in model_tensor_pieces(chunk):
            pieces_of[id(tensor)] = pieces
    sharded: Dict[str, list] = {}
    for sub in _sub_optimizers(optimizer):
        if isinstance(sub, DistributedOptimizer):
            per_param = [_flat_stretch_pieces(sub, param, _pieces(pieces_of, param)) for param in sub.model_params]
        else:
            per_param = [_whole_param_pieces(tensors, _pieces(pieces_of, param))
                         for param, tensors in _whole_param_tensors(sub)]
        for by_name in per_param:
            for name, state_pieces in by_name.items():
                for piece in state_pieces:
                    piece.key = f"{prefix}{name}.{piece.key}"
                    sharded.setdefault(piece.key, []).append(piece)
    return sharded


def _pieces(pieces_of: Dict[int, List[TensorPiece]], param) -> List[TensorPiece]:
    pieces = pieces_of.get(id(param))
    if pieces is None:
        raise ValueError(f"an optimizer param of shape {tuple(param.shape)} is not in the model's state dict")
    return pieces
