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
"""

import math
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor

# A piece of a model tensor and where its first element sits in that tensor, flattened.
TensorPiece = Tuple[ShardedTensor, int]


def _parallel_position() -> Tuple[int, int, int, torch.distributed.ProcessGroup]:
    """(TP rank, TP size, DP rank incl. CP, TP group) - all trivial without torch.distributed."""
    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 0, 1, 0, None
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        raise ValueError("--ckpt-format torch_dist with expert parallelism (EP > 1) is not supported yet")
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
        parallel_state.get_tensor_model_parallel_group(),
    )


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


def _global_key(name: str, renames: Dict[str, str]) -> str:
    for local, global_ in renames.items():
        if name.startswith(local):
            return global_ + name[len(local):]
    return name


def model_tensor_pieces(model: torch.nn.Module, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor,
                                                                               List[TensorPiece]]]:
    """(state-dict name, live tensor, its pieces) for every tensor of `model.state_dict()`.

    Collective over the tensor-parallel group (the partition sizes are gathered).
    """
    tp_rank, tp_size, dp_rank, tp_group = _parallel_position()
    state = {name: value for name, value in model.state_dict(keep_vars=True).items() if value is not None}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"state-dict entry {name} is a {type(value).__name__}: only tensors can be saved with "
                "--ckpt-format torch_dist so far"
            )
    parallel = [name for name, tensor in state.items() if getattr(tensor, "tensor_model_parallel", False)]
    local_sizes = [state[name].shape[state[name].partition_dim] for name in parallel]
    all_sizes = [local_sizes]
    if tp_size > 1:
        all_sizes = [None] * tp_size
        dist.all_gather_object(all_sizes, local_sizes, group=tp_group)
    sizes_by_name = {name: [sizes[i] for sizes in all_sizes] for i, name in enumerate(parallel)}

    renames, tied = _global_layer_names(model), _tied_output_weights(model)
    for name, tensor in state.items():
        key = prefix + _global_key(tied.get(name, name), renames)
        pipeline_copy = 1 if name in tied else 0
        mismatch = getattr(tensor, "is_embedding_or_output_parameter", False)
        if name not in sizes_by_name:
            piece = ShardedTensor(key, tensor, tuple(tensor.shape), (0,) * tensor.dim(),
                                  (pipeline_copy, tp_rank, dp_rank), allow_shape_mismatch=mismatch)
            yield name, tensor, [(piece, 0)]
            continue
        yield name, tensor, _partitioned_pieces(key, tensor, sizes_by_name[name], tp_rank,
                                                (pipeline_copy, 0, dp_rank), mismatch)


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
