"""A model's sharded state dict: each entry of its `state_dict()` as a piece of a global tensor.

Global keys are the state-dict names of the whole (TP=1, PP=1) model, with GLOBAL layer numbers:
`decoder.layers.{layer_number - 1}.self_attention.linear_qkv.weight` whatever the pipeline stage, so a
checkpoint does not depend on TP or PP. Where a tensor sits comes from the attributes every
tensor-parallel layer sets on its params (tensor_parallel/layers.py):

    not tensor_model_parallel   the whole tensor, the same on every TP rank (norms, row-parallel biases)
    partition_dim d, stride 1   rank r holds rows [o_r, o_r + n_r) of dim d, o_r = n_0 + ... + n_{r-1}
    partition_dim d, stride s   the global dim is s blocks (SwiGLU fc1 = [gate; up]); rank r holds its
                                part of each block: local [g_r; u_r] -> global rows of g and of u

The sizes n_r are gathered over the tensor-parallel group (the vocabulary may be split unevenly), so
building the dict is collective over that group. Replica ids are (pipeline copy, TP copy, DP rank):
only (0, 0, 0) writes. The tied output weight of the last pipeline stage is a copy of
`embedding.word_embeddings.weight` (pipeline copy 1).

Routed experts (params marked `allreduce=False`) get GLOBAL expert numbers too (local expert i of a MoE
layer is expert ep_rank x E/ep + i), are split over the expert-tensor-parallel group and replicated
over the expert-data-parallel ranks: their replica ids are (0, expert-TP copy, expert-DP rank), so a
checkpoint does not depend on EP either.
"""

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor

# A piece of a model tensor and where its first element sits in that tensor, flattened.
TensorPiece = Tuple[ShardedTensor, int]
EXPERT_KEY_MARKER = "mlp.experts."


@dataclass(frozen=True)
class _Position:
    """This rank's place: TP (dense params) and expert-TP / expert-DP (routed experts, `allreduce=False`)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object = None
    dp_rank: int = 0
    etp_rank: int = 0
    etp_size: int = 1
    etp_group: object = None
    edp_rank: int = 0


def _parallel_position() -> _Position:
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return _Position()
    return _Position(
        parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
        parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_group(), parallel_state.get_expert_data_parallel_rank(),
    )


def is_expert_key(key: str) -> bool:
    """True for the keys of routed experts (replicated over the expert-data-parallel ranks only)."""
    return EXPERT_KEY_MARKER in key


def _is_expert(tensor: torch.Tensor) -> bool:
    return getattr(tensor, "allreduce", True) is False


def _expert_renames(model: torch.nn.Module) -> Tuple[Dict[str, str], Dict[str, str]]:
    """({local prefix: global prefix}, {local name: global name}) for the routed experts: local expert i
    of a MoE layer is expert `local_expert_indices[i]` (SequentialMLP `local_experts.{i}.`, GroupedMLP
    `linear_fc1.weight{i}`)."""
    prefixes, names = {}, {}
    for module_name, module in model.named_modules():
        indices, experts = getattr(module, "local_expert_indices", None), getattr(module, "experts", None)
        if indices is None or experts is None:
            continue
        prefix = f"{module_name}.experts." if module_name else "experts."
        for local, global_ in enumerate(indices):
            if isinstance(getattr(experts, "local_experts", None), torch.nn.ModuleList):
                prefixes[f"{prefix}local_experts.{local}."] = f"{prefix}local_experts.{global_}."
            else:
                for linear in ("linear_fc1", "linear_fc2"):
                    names[f"{prefix}{linear}.weight{local}"] = f"{prefix}{linear}.weight{global_}"
    return prefixes, names


def _global_layer_names(model: torch.nn.Module) -> Dict[str, str]:
    """{local prefix: global prefix} for the layers of every transformer block, e.g. on pipeline stage 1
    of 2 with 4 layers: {"decoder.layers.0.": "decoder.layers.2.", ...}."""
    renames = {}
    for module_name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        block_prefix = f"{module_name}.layers." if module_name else "layers."
        for index, layer in enumerate(layers):
            layer_number = getattr(layer, "layer_number", None)
            if layer_number is not None:
                renames[f"{block_prefix}{index}."] = f"{block_prefix}{layer_number - 1}."
    return renames


def _tied_output_weights(model: torch.nn.Module) -> Dict[str, str]:
    """{name of a last-stage output weight: name of the word embedding it copies} (PP > 1, tied)."""
    tied = {}
    for module_name, module in model.named_modules():
        if getattr(module, "share_embeddings_and_output_weights", False) and not module.pre_process:
            prefix = f"{module_name}." if module_name else ""
            tied[f"{prefix}output_layer.weight"] = f"{prefix}embedding.word_embeddings.weight"
    return tied


def _renamed_prefix(name: str, renames: Dict[str, str]) -> str:
    for local, global_ in renames.items():
        if name.startswith(local):
            return global_ + name[len(local):]
    return name


def _partition_sizes(state: dict, names: List[str], size: int, group) -> Dict[str, List[int]]:
    """{name: [local size along partition_dim of each rank of `group`]}, gathered (collective)."""
    local_sizes = [state[name].shape[state[name].partition_dim] for name in names]
    all_sizes = [local_sizes]
    if size > 1:
        all_sizes = [None] * size
        dist.all_gather_object(all_sizes, local_sizes, group=group)
    return {name: [sizes[i] for sizes in all_sizes] for i, name in enumerate(names)}


def model_tensor_pieces(model: torch.nn.Module, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor,
                                                                               List[TensorPiece]]]:
    """(state-dict name, live tensor, its pieces) for every tensor of `model.state_dict()`.

    Collective over the tensor-parallel group (the partition sizes are gathered).
    """
    position = _parallel_position()
    state = {name: value for name, value in model.state_dict(keep_vars=True).items() if value is not None}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"state-dict entry {name} is a {type(value).__name__}: only tensors can be saved with "
                "--ckpt-format torch_dist so far"
            )
    parallel = [name for name, tensor in state.items() if getattr(tensor, "tensor_model_parallel", False)]
    sizes = _partition_sizes(state, [name for name in parallel if not _is_expert(state[name])], position.tp_size,
                             position.tp_group)
    sizes.update(_partition_sizes(state, [name for name in parallel if _is_expert(state[name])], position.etp_size,
                                  position.etp_group))

    layer_renames, tied = _global_layer_names(model), _tied_output_weights(model)
    expert_prefixes, expert_names = _expert_renames(model)
    for name, tensor in state.items():
        local_key = expert_names.get(name) or _renamed_prefix(tied.get(name, name), expert_prefixes)
        key = prefix + _renamed_prefix(local_key, layer_renames)
        pipeline_copy = 1 if name in tied else 0
        mismatch = getattr(tensor, "is_embedding_or_output_parameter", False)
        if _is_expert(tensor):
            rank, copy_rank, replica_rank = position.etp_rank, position.etp_rank, position.edp_rank
        else:
            rank, copy_rank, replica_rank = position.tp_rank, position.tp_rank, position.dp_rank
        if name not in sizes:
            piece = ShardedTensor(key, tensor, tuple(tensor.shape), (0,) * tensor.dim(),
                                  (pipeline_copy, copy_rank, replica_rank), allow_shape_mismatch=mismatch)
            yield name, tensor, [(piece, 0)]
            continue
        yield name, tensor, _partitioned_pieces(key, tensor, sizes[name], rank, (pipeline_copy, 0, replica_rank),
                                                mismatch)


def _partitioned_pieces(key, tensor, rank_sizes, tp_rank, replica_id, mismatch) -> List[TensorPiece]:
    """Pieces of a tensor split along `partition_dim` into `partition_stride` blocks, each over the TP ranks:
    local piece k (of n_r / s rows) sits at k * (sum n / s) + (n_0 + ... + n_{r-1}) / s."""
    dim, stride = tensor.partition_dim, getattr(tensor, "partition_stride", 1)
    if any(size % stride for size in rank_sizes):
        raise ValueError(f"{key}: partition sizes {rank_sizes} are not multiples of the stride {stride}")
    if stride > 1 and dim != 0:
        raise ValueError(f"{key}: a partition stride of {stride} along dim {dim} is not supported yet")
    block, rank_offset = sum(rank_sizes) // stride, sum(rank_sizes[:tp_rank]) // stride
    global_shape = list(tensor.shape)
    global_shape[dim] = sum(rank_sizes)
    local_block = tensor.shape[dim] // stride
    row_numel = math.prod(tensor.shape[1:])
    pieces = []
    for k in range(stride):
        offset = [0] * tensor.dim()
        offset[dim] = k * block + rank_offset
        # With stride > 1 (dim 0) piece k is one contiguous stretch of the flattened tensor.
        piece = ShardedTensor(key, tensor.narrow(dim, k * local_block, local_block), tuple(global_shape),
                              tuple(offset), replica_id, allow_shape_mismatch=mismatch)
        pieces.append((piece, k * local_block * row_numel))
    return pieces


def model_sharded_state_dict(model: torch.nn.Module, prefix: str = "") -> Dict[str, object]:
    """{state-dict name: ShardedTensor (or a list of them for strided partitions)} of `model`, whose
    data are the live tensors: loading into it loads the model in place. Collective over TP."""
    sharded = {}
    for name, _, pieces in model_tensor_pieces(model, prefix):
        sharded[name] = pieces[0][0] if len(pieces) == 1 else [piece for piece, _ in pieces]
    return sharded
