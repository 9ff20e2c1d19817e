"""Optimizer param groups: which params get weight decay, a scaled or a decoupled learning rate.

Every param lands in the group of its key

    (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr, overrides)

  wd_mult 0.0      biases (name ends in `.bias`) and 1-D params (norm weights), except the q/k layernorms'
                   (`q_layernorm.`, `k_layernorm.`) with `apply_wd_to_qk_layernorm`, unless
                   `no_weight_decay_cond(name, param)` decides otherwise
  lr_mult          `lr_mult` where `scale_lr_cond(name, param)` holds (fine-tuning heads), else 1.0
  is_expert_par.   `param.allreduce is False` (MoE experts: reduced over the expert data-parallel group)
  is_decoupled_lr  `param.is_embedding_or_output_parameter` when a decoupled LR is configured
  overrides        `group_overrides(name, param)`: values the group gets as they are (muP's `max_lr`, `min_lr`,
                   `eps`, optimizer/mup.py)

Each group also carries `max_lr`/`min_lr`, which the scheduler decays between.

Group order is Megatron-LM's, because a torch-format optimizer state indexes params by their position over
all groups: every rank lists the union of the keys of all ranks (a pipeline stage without, say, decoupled-LR
params holds that group empty), the group without overrides first, then the others sorted by their sorted
(override name, value) pairs (`max_lr` for the decoupled LR, `lr_mult`, `wd_mult`, the `overrides`); equal
overrides keep the order in which the params first appear.
"""

from typing import Callable, Dict, List, Optional, Tuple

import torch

PARAM_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def get_param_groups(
    model_chunks: List[torch.nn.Module],
    no_weight_decay_cond: Optional[Callable] = None,
    scale_lr_cond: Optional[Callable] = None,
    lr_mult: float = 1.0,
    use_decoupled_learning_rate: bool = False,
    apply_wd_to_qk_layernorm: bool = False,
    group_overrides: Optional[Callable] = None,
) -> List[Dict]:
    """Groups the trainable params of `model_chunks` by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr,
    overrides)."""
    params_by_key: Dict[Tuple, List[torch.nn.Parameter]] = {}
    for model_chunk in model_chunks:
        for name, param in model_chunk.named_parameters():
            if not param.requires_grad:
                continue
            if no_weight_decay_cond is not None:
                no_weight_decay = no_weight_decay_cond(name, param)
            else:
                no_weight_decay = (name.endswith(".bias") or len(param.shape) == 1) and not (
                    apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name)
                )
            scale_lr = scale_lr_cond is not None and scale_lr_cond(name, param)
            key = (
                0.0 if no_weight_decay else 1.0,
                lr_mult if scale_lr else 1.0,
                not getattr(param, "allreduce", True),
                use_decoupled_learning_rate and getattr(param, "is_embedding_or_output_parameter", False),
                tuple(sorted(group_overrides(name, param).items())) if group_overrides is not None else (),
            )
            params_by_key.setdefault(key, []).append(param)
    keys = list(params_by_key)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        every_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every_rank, keys)
        keys = list(dict.fromkeys(keys + [key for rank_keys in every_rank for key in rank_keys]))
    keys.sort(key=_megatron_order)
    # default_config: the group follows the run's own LR schedule (Megatron-LM logs the lr of such a group).
    return [{"params": params, **dict(zip(PARAM_GROUP_KEYS, key)), **dict(key[4]),
             "default_config": key[1] == 1.0 and not key[3] and not any("lr" in name for name, _ in key[4])}
            for key, params in ((key, params_by_key.get(key, [])) for key in keys)]


def _megatron_order(key: Tuple) -> Tuple:
    """Megatron-LM's sort key of a group: (has overrides, its overrides as sorted (name, value) pairs)."""
    wd_mult, lr_mult, _, is_decoupled_lr, group_overrides = key
    overrides = sorted(
        [("max_lr", 0.0)] * is_decoupled_lr + [("lr_mult", lr_mult)] * (lr_mult != 1.0)
        + [("wd_mult", wd_mult)] * (wd_mult != 1.0) + list(group_overrides)
    )
    return (bool(overrides), tuple(overrides))


def set_min_and_max_lr(
    param_groups: List[Dict],
    lr: float,
    min_lr: Optional[float],
    decoupled_lr: Optional[float],
    decoupled_min_lr: Optional[float],
) -> None:
    """Writes each group's `max_lr`/`min_lr`: the decoupled pair for embedding/output groups, else (lr, min_lr);
    a group that has its own (its `overrides`) keeps them."""
    min_lr = 0.0 if min_lr is None else min_lr
    decoupled_min_lr = min_lr if decoupled_min_lr is None else decoupled_min_lr
    for group in param_groups:
        pair = (decoupled_lr, decoupled_min_lr) if group["is_decoupled_lr"] else (lr, min_lr)
        group.setdefault("max_lr", pair[0])
        group.setdefault("min_lr", pair[1])


def _group_key(group: Dict) -> Tuple:
    return tuple(group.get(key) for key in PARAM_GROUP_KEYS)


def _describe(group: Dict, with_size: bool) -> str:
    size = f" with {len(group['params'])} params" if with_size else ""
    return f"{dict(zip(PARAM_GROUP_KEYS, _group_key(group)))}{size}"


def reorder_saved_param_groups(
    current_groups: List[Dict], saved_groups: List[Dict], match_sizes: bool = True
) -> List[int]:
    """For each current param group, the index of the checkpoint group it continues.

    Groups are matched by their (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) key and, with
    `match_sizes`, their number of params, so a checkpoint whose groups were built in another order still
    loads onto the right params. The distributed optimizer's saved groups list no params (its state is
    sharded over data-parallel ranks): it matches by key only.
    """
    if match_sizes and any("params" not in group for group in saved_groups):
        raise ValueError(
            "the checkpoint's optimizer state was saved with the distributed optimizer (its per-parameter state "
            "is in distrib_optim.pt): resume with --use-distributed-optimizer, or pass --no-load-optim"
        )
    if len(current_groups) != len(saved_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, this model's has "
            f"{len(current_groups)}: was it written for another model or another --decoupled-lr setting?"
        )
    remaining = list(range(len(saved_groups)))
    order = []
    for group in current_groups:
        match = next(
            (
                index
                for index in remaining
                if _group_key(saved_groups[index]) == _group_key(group)
                and (not match_sizes or len(saved_groups[index]["params"]) == len(group["params"]))
            ),
            None,
        )
        if match is None:
            available = "; ".join(_describe(saved, match_sizes) for saved in saved_groups)
            raise ValueError(
                f"no param group in the checkpoint matches {_describe(group, match_sizes)}; the checkpoint has: "
                f"{available}"
            )
        remaining.remove(match)
        order.append(match)
    return order
