"""A model's sharded state dict: each entry of its `state_dict()` as a piece of a global tensor, under
Megatron-Core's keys, so that a torch_dist checkpoint moves between this project and Megatron-LM and loads
under any TP / PP / DP layout.

Keys (Megatron-Core's `sharded_state_dict` of its local-spec models):

    embedding.word_embeddings.weight, output_layer.weight, decoder.final_layernorm.weight, ...
                                    the state-dict name
    decoder.layers.<name in layer>  the layers of a transformer block stacked along a prepended axis:
                                    global shape [num_layers, *shape], layer l (global number l+1) at l
    decoder.layers.<l>.<name>       instead, when the block's layers differ (MoE only every k-th layer)

with the layer's norms under the names of the linears they precede (Transformer Engine's fused modules):
`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_` (`self_attention.in_proj.layer_norm_` in a Gated
DeltaNet layer), `pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`. Every parallel linear of a layer also
has `<linear>._extra_state`, a ShardedObject on the layer grid (its FP8 scaling state, None without one), as Megatron-Core writes it.

Where a tensor sits comes from the attributes every tensor-parallel layer sets on its params
(tensor_parallel/layers.py):

    not tensor_model_parallel   the whole tensor, the same on every TP rank (norms, row-parallel biases)
    partition_dim d, stride 1   rank r holds rows [o_r, o_r + n_r) of dim d, o_r = n_0 + ... + n_{r-1}
    partition_dim d, stride s   the global dim is s blocks (SwiGLU fc1 = [gate; up]); rank r holds its
                                part of each block: local [g_r; u_r] -> global rows of g and of u
    partition_sections (n_k)    the same with unequal blocks of global sizes n_k (Gated DeltaNet's
                                [q; k; v; z; beta; alpha]): local block k, n_k / p rows, at global
                                n_0 + ... + n_{k-1} + r n_k / p

The sizes n_r are gathered over the tensor-parallel group (the vocabulary may be split unevenly), so
building the dict is collective over that group. Replica ids are (pipeline copy, TP copy, DP rank):
only (0, 0, 0) writes. The tied output weight of the last pipeline stage, or its word embedding with
multi-token prediction, is a copy of `embedding.word_embeddings.weight` (pipeline copy 1).

A weight stored in FP8 (float8 dtype, megatron/core/fp8/params.py) is saved as its value in the dtype it
stands for (bf16 under --bf16), which its layer's state dict gives, as Megatron-LM writes Transformer Engine's
FP8 params, and loaded through that dtype and a cast by its layer, so its checkpoint loads into a run without
FP8 weights and the other way round.

Routed experts (params marked `allreduce=False`) get GLOBAL expert numbers (local expert i of a MoE layer is
expert ep_rank x E/ep + i), are split over the expert-tensor-parallel group and replicated over the
expert-data-parallel ranks: their replica ids are (0, expert-TP copy, expert-DP rank), so a checkpoint does
not depend on EP either (these keys are this project's: Megatron-LM's MoE layout is not followed yet).
"""

import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.fully_sharded_pieces import flat_stretch_pieces, local_row_pieces, shape_carrier
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, TensorPiece
from megatron.core.dtensor_shards import is_fully_sharded

EXPERT_KEY_MARKER = "mlp.experts."
EXTRA_STATE_SUFFIX = "_extra_state"
# Megatron-Core's sharded_state_dict_keys_map of its local layer specs (GPT, BERT, T5).
LAYER_KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# A Gated DeltaNet layer's (megatron/core/ssm), whose input norm Megatron-Core fuses into `in_proj`.
LINEAR_ATTENTION_LAYER_KEYS_MAP = {**LAYER_KEYS_MAP, "input_layernorm.": "self_attention.in_proj.layer_norm_"}


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


@dataclass(frozen=True)
class _LayerPlace:
    """Where the layer under a local prefix goes: its global key prefix and, when the block's layers are
    stacked, its index along the prepended axis of `num_layers`."""

    key_prefix: str
    index: Optional[int]
    num_layers: int
    renames: Dict[str, str] = field(default_factory=lambda: LAYER_KEYS_MAP)

    def prepend(self, shape: tuple, offset: tuple) -> Tuple[tuple, tuple]:
        if self.index is None:
            return shape, offset
        return (self.num_layers, *shape), (self.index, *offset)


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


def _stacks_layers(config) -> bool:
    """Whether a block's layers share one key per tensor (Megatron-Core's homogeneous layers): not when MoE
    layers alternate with dense ones, nor linear attention with softmax attention."""
    frequencies = (getattr(config, "moe_layer_freq", 1), getattr(config, "linear_attention_freq", None) or 1)
    return all(isinstance(frequency, int) and frequency <= 1 for frequency in frequencies)


def _layer_places(model: torch.nn.Module) -> Dict[str, _LayerPlace]:
    """{local prefix of a layer: its place}, e.g. on pipeline stage 1 of 2 with 4 layers:
    {"decoder.layers.0.": _LayerPlace("decoder.layers.", 2, 4), ...}."""
    places = {}
    for module_name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        block_prefix = f"{module_name}.layers." if module_name else "layers."
        config = getattr(module, "config", None)
        stacked = _stacks_layers(config)
        for index, layer in enumerate(layers):
            layer_number = getattr(layer, "layer_number", None)
            if layer_number is None:
                continue
            linear_attention = hasattr(getattr(layer, "self_attention", None), "in_proj")
            renames = LINEAR_ATTENTION_LAYER_KEYS_MAP if linear_attention else LAYER_KEYS_MAP
            if stacked:
                places[f"{block_prefix}{index}."] = _LayerPlace(block_prefix, layer_number - 1, config.num_layers,
                                                                renames)
            else:
                places[f"{block_prefix}{index}."] = _LayerPlace(f"{block_prefix}{layer_number - 1}.", None, 1, renames)
    return places


def _tied_output_weights(model: torch.nn.Module) -> Dict[str, str]:
    """{name of a last-stage copy of the word embedding: the embedding's name} (PP > 1): a tied output weight,
    or the word embedding of a last stage with multi-token prediction."""
    tied = {}
    for module_name, module in model.named_modules():
        if getattr(module, "pre_process", True):
            continue
        prefix = f"{module_name}." if module_name else ""
        embedding = f"{prefix}embedding.word_embeddings.weight"
        if getattr(module, "embedding", None) is not None:
            tied[embedding] = embedding
        elif getattr(module, "share_embeddings_and_output_weights", False):
            tied[f"{prefix}output_layer.weight"] = embedding
    return tied


def _renamed_prefix(name: str, renames: Dict[str, str]) -> str:
    for local, global_ in renames.items():
        if name.startswith(local):
            return global_ + name[len(local):]
    return name


def state_dict_names(key: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The inverse of the key mapping for one whole global tensor of a checkpoint: {state-dict name of a
    TP = PP = 1 model: tensor}, one per layer for a stacked key (`decoder.layers.<name in layer>`)."""
    for block in ("decoder.layers.", "encoder.layers."):
        if not key.startswith(block):
            continue
        rest = key[len(block):]
        index, _, in_layer = rest.partition(".")
        if index.isdigit():  # the layers of a non-homogeneous block: one key each
            return {f"{block}{index}.{_original_layer_name(in_layer)}": tensor}
        return {f"{block}{layer}.{_original_layer_name(rest)}": tensor[layer] for layer in range(tensor.shape[0])}
    return {key: tensor}


def _original_layer_name(name: str) -> str:
    for renames in (LAYER_KEYS_MAP, LINEAR_ATTENTION_LAYER_KEYS_MAP):
        for local, stored in renames.items():
            if name.startswith(stored):
                return local + name[len(stored):]
    return name


class _Keys:
    """The global key (and layer place) of each state-dict name of one model chunk."""

    def __init__(self, model: torch.nn.Module, prefix: str):
        self.prefix = prefix
        self.places = _layer_places(model)
        self.tied = _tied_output_weights(model)
        self.expert_prefixes, self.expert_names = _expert_renames(model)

    def __call__(self, name: str) -> Tuple[str, Optional[_LayerPlace]]:
        local = self.expert_names.get(name) or _renamed_prefix(self.tied.get(name, name), self.expert_prefixes)
        for local_prefix, place in self.places.items():
            if local.startswith(local_prefix):
                rest = _renamed_prefix(local[len(local_prefix):], place.renames)
                return self.prefix + place.key_prefix + rest, place
        return self.prefix + local, None


_UNSTACKED = _LayerPlace("", None, 1)


def _place(place: Optional[_LayerPlace]) -> _LayerPlace:
    return place if place is not None else _UNSTACKED


def _stacked(tensor: torch.Tensor, place: Optional[_LayerPlace]) -> torch.Tensor:
    """`tensor` with the prepended layer axis (a view: loading into it loads the live tensor)."""
    return tensor.unsqueeze(0) if _place(place).index is not None else tensor


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
    """(state-dict name, live tensor, its pieces) for every tensor of `model.state_dict()` (not the
    `_extra_state` entries: `model_extra_state_objects`); an FSDP shard's pieces are this rank's rows of the
    whole param's (fully_sharded_pieces.py). A param of Megatron-FSDP's ZeRO-3 (tagged `data_parallel_stretch`,
    its storage mostly released) gets the whole param's pieces without data (meta tensors).

    Collective over the tensor-parallel group (the partition sizes are gathered).
    """
    position = _parallel_position()
    state = {name: value for name, value in model.state_dict(keep_vars=True).items()
             if value is not None and not name.endswith(EXTRA_STATE_SUFFIX)}
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
    keys = _Keys(model, prefix)
    for name, tensor in state.items():
        if is_fully_sharded(tensor):
            yield name, tensor, local_row_pieces(_tensor_pieces(name, shape_carrier(tensor), keys, sizes, position),
                                                 tensor)
        elif hasattr(tensor, "data_parallel_stretch"):
            yield name, tensor, _tensor_pieces(name, shape_carrier(tensor), keys, sizes, position)
        else:
            yield name, tensor, _tensor_pieces(name, tensor, keys, sizes, position)


def _tensor_pieces(name: str, tensor: torch.Tensor, keys: "_Keys", sizes: Dict[str, List[int]],
                   position: _Position) -> List[TensorPiece]:
    """The pieces of the (TP-local) state-dict tensor `name`."""
    key, place = keys(name)
    pipeline_copy = 1 if name in keys.tied else 0
    mismatch = getattr(tensor, "is_embedding_or_output_parameter", False)
    if _is_expert(tensor):
        rank, copy_rank, replica_rank = position.etp_rank, position.etp_rank, position.edp_rank
    else:
        rank, copy_rank, replica_rank = position.tp_rank, position.tp_rank, position.dp_rank
    if name not in sizes:
        shape, offset = _place(place).prepend(tuple(tensor.shape), (0,) * tensor.dim())
        return [(ShardedTensor(key, _stacked(tensor, place), shape, offset, (pipeline_copy, copy_rank, replica_rank),
                               allow_shape_mismatch=mismatch), 0)]
    return _partitioned_pieces(key, tensor, sizes[name], rank, (pipeline_copy, 0, replica_rank), mismatch, place)


def _partitioned_pieces(key, tensor, rank_sizes, tp_rank, replica_id, mismatch, place) -> List[TensorPiece]:
    """Pieces of a tensor split along `partition_dim` into `partition_stride` blocks, each over the TP ranks:
    local piece k (of n_r / s rows) sits at k * (sum n / s) + (n_0 + ... + n_{r-1}) / s."""
    dim, stride = tensor.partition_dim, getattr(tensor, "partition_stride", 1)
    sections = getattr(tensor, "partition_sections", None)
    if sections:
        return _sectioned_pieces(key, tensor, sections, len(rank_sizes), tp_rank, replica_id, mismatch, place)
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
        shape, offset = _place(place).prepend(tuple(global_shape), tuple(offset))
        # With stride > 1 (dim 0) piece k is one contiguous stretch of the flattened tensor.
        data = _stacked(tensor.narrow(dim, k * local_block, local_block), place)
        pieces.append((ShardedTensor(key, data, shape, offset, replica_id, allow_shape_mismatch=mismatch),
                       k * local_block * row_numel))
    return pieces


def _sectioned_pieces(key, tensor, sections, tp_size, tp_rank, replica_id, mismatch, place) -> List[TensorPiece]:
    """Pieces of a tensor whose `partition_dim` is unequal blocks of global sizes `sections`, each split evenly
    over the TP ranks (module docstring)."""
    dim = tensor.partition_dim
    if dim != 0:
        raise ValueError(f"{key}: partition sections along dim {dim} are not supported yet")
    global_shape, row_numel = (sum(sections), *tensor.shape[1:]), math.prod(tensor.shape[1:])
    pieces, local_start = [], 0
    for start, size in zip(itertools.accumulate((0, *sections)), sections):
        local = size // tp_size
        offset = (start + tp_rank * local,) + (0,) * (tensor.dim() - 1)
        shape, offset = _place(place).prepend(global_shape, offset)
        data = _stacked(tensor.narrow(0, local_start, local), place)
        pieces.append((ShardedTensor(key, data, shape, offset, replica_id, allow_shape_mismatch=mismatch),
                       local_start * row_numel))
        local_start += local
    return pieces


def _stored_in_fp8(tensor: Optional[torch.Tensor]) -> bool:
    """A weight its layer stores in FP8 (the module docstring): its state-dict value is in high precision."""
    return tensor is not None and tensor.dtype == torch.float8_e4m3fn


def _parallel_linears(model: torch.nn.Module, output_layer: bool = False) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(name, module) of the parallel linears whose `_extra_state` Megatron-Core checkpoints: all of them in
    a torch-format file, all but the model's output layer in a sharded one (GPTModel drops that one's)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and (
                output_layer or not name.endswith("output_layer")):
            yield name, module


def with_linear_extra_states(model: torch.nn.Module, state: Dict[str, object]) -> Dict[str, object]:
    """`state` (model.state_dict()) with `<linear>._extra_state` after each parallel linear's entries, None
    where the linear keeps no FP8 state: the torch-format model dict as Megatron-Core's linears write it."""
    prefixes = [f"{name}." for name, _ in _parallel_linears(model, output_layer=True)]
    last = {}
    for index, name in enumerate(state):
        for prefix in prefixes:
            if name.startswith(prefix):
                last[prefix] = index
    result = {}
    for index, (name, value) in enumerate(state.items()):
        result[name] = value
        for prefix in prefixes:
            if last.get(prefix) == index:
                result.setdefault(prefix + EXTRA_STATE_SUFFIX, None)
    for prefix in prefixes:  # a linear without params (the tied output layer)
        result.setdefault(prefix + EXTRA_STATE_SUFFIX, None)
    return result


def model_extra_state_objects(model: torch.nn.Module, prefix: str = "") -> Dict[str, ShardedObject]:
    """{`<linear>._extra_state`: ShardedObject} of every parallel linear: its FP8 scaling state (None
    without one), on the layer grid, replicated over TP and DP (routed experts: over expert TP and DP)."""
    position = _parallel_position()
    state = model.state_dict(keep_vars=True)
    keys = _Keys(model, prefix)
    objects = {}
    for module_name, module in _parallel_linears(model):
        name = f"{module_name}.{EXTRA_STATE_SUFFIX}"
        key, place = keys(name)
        expert = any(_is_expert(param) for param in module.parameters())
        replica_id = (0, position.etp_rank, position.edp_rank) if expert else (0, position.tp_rank, position.dp_rank)
        shape, offset = _place(place).prepend((), ())
        objects[name] = ShardedObject(key, state.get(name), shape or (1,), offset or (0,), replica_id)
    return objects


def without_absent_extra_states(model_request: Dict[str, object], saved: set) -> Dict[str, object]:
    """`model_request` less the `_extra_state` objects that the checkpoint (its `saved` keys) lacks: an FP8 run
    resuming a checkpoint saved without them starts its scales afresh, as Transformer Engine does, and
    Megatron-LM's --ckpt-drop-redundant-extra-state leaves them out; every other key must be there."""
    return {name: piece for name, piece in model_request.items()
            if not name.endswith(EXTRA_STATE_SUFFIX) or piece.unique_key in saved}


def load_extra_states(model: torch.nn.Module, loaded: Dict[str, object]) -> None:
    """Gives each parallel linear the `_extra_state` loaded for it (FP8 scaling state; None is ignored), then
    a weight stored in FP8 its loaded high-precision value, cast with that state."""
    for module_name, module in _parallel_linears(model):
        state = {}
        value = loaded.get(f"{module_name}.{EXTRA_STATE_SUFFIX}")
        if value is not None:
            state[EXTRA_STATE_SUFFIX] = value
        weight = loaded.get(f"{module_name}.weight")
        if _stored_in_fp8(module.weight) and weight is not None:
            pieces = weight if isinstance(weight, list) else [weight]  # in order, tiling the flattened weight
            state["weight"] = torch.cat([piece.reshape(-1) for piece in pieces]).view(module.weight.shape)
        if state:
            module.load_state_dict(state, strict=False)


def model_sharded_state_dict(model: torch.nn.Module, prefix: str = "", is_loading: bool = False,
                             without_fully_sharded: bool = False) -> Dict[str, object]:
    """{state-dict name: ShardedTensor (or a list of them for strided partitions) or ShardedObject} of
    `model`; the tensors' data are the live tensors, so loading into it loads the model in place (the
    `_extra_state` objects, and weights stored in FP8, then go in with `load_extra_states`). Collective over TP.

    FSDP shards (fully_sharded_pieces.py) are saved in their `saved_dtype` (the dtype a DDP run of the same
    precision keeps its params in: bf16 copies of the fp32 shards under --bf16) and loaded into the fp32 shards
    (DCP converts); `without_fully_sharded` leaves them out, for a load whose optimizer entry brings the fp32
    main params into the same shards. A param of Megatron-FSDP's ZeRO-3 is saved from and loaded into this rank's
    stretch of it, its `data_parallel_stretch` (flattened-range pieces: fully_sharded_pieces.py)."""
    sharded = {}
    tensor_pieces = list(model_tensor_pieces(model, prefix))
    values = model.state_dict() if any(_stored_in_fp8(tensor) for _, tensor, _ in tensor_pieces) else {}
    for name, tensor, pieces in tensor_pieces:
        if _stored_in_fp8(tensor):
            # Saved: the value in high precision; loaded: into such a copy (initially the current value, for a
            # key the checkpoint lacks), which `load_extra_states` casts into the weight.
            value = values[name].reshape(-1)
            pieces = [(piece.with_data(value[start : start + piece.data.numel()].view(piece.local_shape)), start)
                      for piece, start in pieces]
        if hasattr(tensor, "data_parallel_stretch"):
            pieces = flat_stretch_pieces(pieces, *tensor.data_parallel_stretch)
        if is_fully_sharded(tensor):
            if without_fully_sharded:
                continue
            saved_dtype = getattr(tensor, "saved_dtype", tensor.dtype)
            if not is_loading and saved_dtype != tensor.dtype:
                pieces = [(piece.with_data(piece.data.to("cpu", saved_dtype)), start) for piece, start in pieces]
        sharded[name] = pieces[0][0] if len(pieces) == 1 else [piece for piece, _ in pieces]
    sharded.update(model_extra_state_objects(model, prefix))
    return sharded
