"""Split a full GPTModel state dict into tensor-parallel shards and merge shards back (reference 8.3, 8.4).

    column-parallel, dim 0:  linear_qkv (rows grouped per query group: each rank holds ng/TP whole groups),
                             linear_fc1 (SwiGLU: rank i holds [gate_i; up_i], see split_swiglu_fc1),
                             embedding.word_embeddings, output_layer (vocab rows), multi-latent attention's
                             linear_q_proj / linear_q_up_proj / linear_kv_up_proj (whole heads), MTP eh_proj
    row-parallel, dim 1:     linear_proj.weight, linear_fc2.weight
    replicated:              norms, linear_proj/linear_fc2 biases, position embeddings, MoE routers and expert
                             biases, multi-latent attention's down projections
    Each routed expert's linear_fc1 / linear_fc2 splits as the dense ones do (expert-TP = TP).

Merging concatenates in the same order; replicated tensors are taken from rank 0, as Megatron's loaders do.
"""

import torch

from megatron.training.checkpointing.conversion.gpt_shape import GPTShape

_COLUMN_PARALLEL = (
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "embedding.word_embeddings.weight", "output_layer.weight",
    # multi-latent attention's per-head up projections, multi-token prediction's eh_proj
    "self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_up_proj.weight", "eh_proj.weight",
)
# Suffixes of the dense MLP's and of each expert's (`mlp.experts.local_experts.E.linear_fc1.weight`) linears.
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")
_FC1 = ("linear_fc1.weight", "mlp.linear_fc1.bias")


def check_tensor_parallel_size(shape: GPTShape, tp: int) -> None:
    """Raises one ValueError listing every dimension that `tp` does not divide, with the legal sizes."""
    problems = []
    dimensions = (
        ("attention heads", shape.num_attention_heads),
        ("query groups", shape.num_query_groups),
        ("ffn_hidden_size", shape.ffn_hidden_size),
    ) + ((("moe_ffn_hidden_size", shape.moe_ffn_hidden_size),) if shape.num_experts else ())
    for what, size in dimensions:
        if size % tp:
            legal = [d for d in range(1, size + 1) if size % d == 0]
            problems.append(f"TP {tp} must divide the {size} {what}: legal sizes {', '.join(map(str, legal))}")
    if problems:
        raise ValueError("--target-tensor-parallel-size does not fit the model:\n  - " + "\n  - ".join(problems))


def split_swiglu_fc1(fc1: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Full [gate; up] (2f rows) -> per rank [gate_i; up_i] (2f/TP rows): gate and up are split separately."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return [torch.cat([g, u], dim=0) for g, u in zip(torch.chunk(gate, tp, dim=0), torch.chunk(up, tp, dim=0))]


def merge_swiglu_fc1(shards: list[torch.Tensor]) -> torch.Tensor:
    """Per rank [gate_i; up_i] -> full cat([gate_0 .. gate_p-1, up_0 .. up_p-1])."""
    halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)


def _split_dim(name: str) -> int | None:
    """0 for column-parallel tensors, 1 for row-parallel weights, None for replicated ones."""
    if name.endswith(_COLUMN_PARALLEL) or name.endswith(_FC1):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def split_tensor_parallel(state: dict, tp: int, swiglu: bool) -> list[dict]:
    """The TP shards (one state dict per rank, views cloned) of a full state dict."""
    shards = [{} for _ in range(tp)]
    for name, tensor in state.items():
        if swiglu and name.endswith(_FC1):
            pieces = split_swiglu_fc1(tensor, tp)
        elif _split_dim(name) is None:
            pieces = [tensor] * tp
        else:
            pieces = torch.chunk(tensor, tp, dim=_split_dim(name))
        for shard, piece in zip(shards, pieces):
            shard[name] = piece.clone()
    return shards


def merge_tensor_parallel(shards: list[dict], swiglu: bool) -> dict:
    """The full state dict of TP shards (inverse of `split_tensor_parallel`)."""
    merged = {}
    for name, first in shards[0].items():
        pieces = [shard[name] for shard in shards]
        if swiglu and name.endswith(_FC1):
            merged[name] = merge_swiglu_fc1(pieces)
        elif _split_dim(name) is None:
            merged[name] = first
        else:
            merged[name] = torch.cat(pieces, dim=_split_dim(name))
    return merged
