"""Tensor-parallel linear and embedding layers (Megatron-Core names, signatures and attributes).

At TP = 1 they are plain `nn.Linear` / `nn.Embedding` that return `(output, bias)`. With p TP ranks:

    ColumnParallelLinear   Y = X A + b,  A = [A_1 ... A_p] split by output columns; weight [out/p, in]
    RowParallelLinear      Y = sum_i X_i A_i + b,  A split by input rows;          weight [out, in/p]
    VocabParallelEmbedding rank r owns vocabulary rows [r*V/p, (r+1)*V/p);          weight [V/p, h]

(weights are stored transposed, as in `nn.Linear`: [out, in]). With `use_cpu_initialization` each rank
draws the whole master weight with the CPU generator and keeps its slice, so the model does not depend
on p; otherwise each rank draws its own shard from the `model-parallel-rng` stream on the device.

At TP > 1 (bf16/fp32 GEMMs) the linears' GEMMs and collectives run in the autograd Functions of
linear_with_comm.py: the backward collectives run during the other GEMM, and with `tp_comm_overlap` the
sequence-parallel ones are fused with the GEMMs that produce or consume them.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.fp8.params import apply_keeping_fp8_weight
from megatron.core.fp8.scaling import load_fp8_extra_state, save_fp8_extra_state
from megatron.core.fusions.fused_weight_gradient import can_accumulate_in_main_grad, linear_with_grad_accumulation
from megatron.core.model_parallel_config import ModelParallelConfig, reject_unsupported
from megatron.core.tensor_parallel.linear_with_comm import column_parallel_linear, row_parallel_linear_reduce_scatter
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.partition import partition_range, partition_size
from megatron.core.tensor_parallel.random import model_parallel_rng_region

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1, "partition_sections": None
}


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int | tuple[int, ...]
) -> None:
    """Marks a parameter as split over TP along `dim` (read by grad-norm, checkpoint and converter code).

    `stride`: the number of equal blocks of `dim` that are split over TP each (2 for SwiGLU's fused [gate; up]),
    or the global sizes of unequal blocks (Gated DeltaNet's fused [q; k; v; z; beta; alpha]), which become
    `partition_sections` (`partition_stride` is then their count): rank r holds r's part of every block."""
    sections = tuple(stride) if isinstance(stride, (tuple, list)) else None
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = len(sections) if sections else stride
    tensor.partition_sections = sections


def partition_blocks(size: int, stride: int | tuple[int, ...]) -> list[int]:
    """The global sizes of the blocks of a dimension of `size` that are split over TP separately."""
    if isinstance(stride, (tuple, list)):
        if sum(stride) != size:
            raise ValueError(f"partition sections {tuple(stride)} do not add up to the dimension's {size}")
        return list(stride)
    return [size // stride] * stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Gives an unmarked parameter the "replicated over TP" attributes."""
    for name, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copies the TP attributes of `source` (e.g. onto its fp32 master copy)."""
    for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tensor_parallel_rank: int | None = None) -> bool:
    """True if this rank should count `param`: TP shards always, replicated params on TP rank 0
    (`tensor_parallel_rank` defaults to this rank's TP rank; expert params pass their expert-TP rank)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if tensor_parallel_rank is None:
        tensor_parallel_rank = parallel_state.get_tensor_model_parallel_rank()
    return tensor_parallel_rank == 0


def parameter_device(config: ModelParallelConfig) -> torch.device:
    """Where parameters are created: the CPU with `use_cpu_initialization`, else the current GPU (if any)."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _tp_rank_and_size(tp_group) -> tuple[int, int]:
    if tp_group is not None:
        return dist.get_rank(tp_group), dist.get_world_size(tp_group)
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _check_last_rank_not_empty(size: int, world_size: int, what: str) -> None:
    if partition_size(size, world_size - 1, world_size) == 0:
        raise ValueError(f"{what} of {size} is too small to split over {world_size} tensor-parallel ranks")


def initialize_affine_weight(weight, full_shape, partition_dim, init_method, stride, config, rank, world_size):
    """Initialises this rank's shard `weight` of a [full_shape] master weight split along `partition_dim`.

    `stride` > 1 splits each of `stride` equal blocks separately, so a fused [gate; up] fc1 gives every
    rank [gate_r; up_r]; a tuple of block sizes does the same with unequal blocks.
    """
    set_tensor_model_parallel_attributes(weight, world_size > 1, partition_dim, stride)
    if not config.perform_initialization:
        return
    if not config.use_cpu_initialization:
        with model_parallel_rng_region(), torch.no_grad():
            init_method(weight)
        return
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    master = master.to(config.params_dtype)
    pieces = []
    for block in master.split(partition_blocks(full_shape[partition_dim], stride), dim=partition_dim):
        start, end = partition_range(block.size(partition_dim), rank, world_size)
        pieces.append(block.narrow(partition_dim, start, end - start))
    with torch.no_grad():
        weight.copy_(torch.cat(pieces, dim=partition_dim))


def _prepare_fp8(layer: torch.nn.Module) -> None:
    """`layer.fp8` (an `Fp8Scaling`, set by a transformer layer that runs in FP8) or None; its state is
    saved as `<layer>._extra_state` and restored from there (megatron/core/fp8/scaling.py). The layer's
    `_apply` keeps a weight stored in FP8 out of dtype casts (megatron/core/fp8/params.py)."""
    layer.fp8 = None
    layer.register_state_dict_post_hook(save_fp8_extra_state)
    layer.register_load_state_dict_pre_hook(load_fp8_extra_state)


def _local_gemm(layer: torch.nn.Module, input_: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """The layer's own GEMM: FP8, or with the weight gradient accumulated into `main_grad`, or F.linear."""
    fusion = layer.config.gradient_accumulation_fusion
    if layer.fp8 is not None:
        # Imported here: fp8/linear.py loads torch._dynamo (its `torch.compiler.disable`), a second of start-up
        # that a run without FP8 does not pay.
        from megatron.core.fp8.linear import fp8_linear

        return fp8_linear(input_, weight, bias, layer.fp8, fusion)
    if fusion:
        return linear_with_grad_accumulation(input_, weight, bias)
    return F.linear(input_, weight, bias)


def _communicating_gemm(layer: torch.nn.Module, input_: torch.Tensor) -> dict | None:
    """The arguments of linear_with_comm.py's GEMMs for `layer` at TP > 1, or None where the layer keeps
    the separate collective and GEMM (TP = 1, FP8 GEMMs, autocast)."""
    if layer.tp_world_size == 1 or layer.fp8 is not None or torch.is_autocast_enabled(input_.device.type):
        return None
    group = layer.tp_group if layer.tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    return dict(group=group, rank=layer.tp_rank, world_size=layer.tp_world_size, overlap=layer.config.tp_comm_overlap)


def _accumulates(layer: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether `weight`'s gradient goes into its main_grad (gradient-accumulation fusion)."""
    return layer.config.gradient_accumulation_fusion and can_accumulate_in_main_grad(weight)


def _zero_bias(size: int, config: ModelParallelConfig) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(size, dtype=config.params_dtype, device=parameter_device(config)))


def _empty_weight(rows: int, columns: int, config: ModelParallelConfig) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(rows, columns, dtype=config.params_dtype, device=parameter_device(config)))


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by output columns; returns `(output, bias if skip_bias_add else None)`.

    Input [s, b, in] (or [s/p, b, in] with sequence parallelism, all-gathered here); output
    [s, b, out/p], or [s, b, out] with `gather_output`. `output_size` need not divide by p (the
    vocabulary of an output layer), see `partition.py`. `tp_comm_buffer_name` only names a Transformer
    Engine comm-overlap buffer in Megatron-LM; it is accepted so that Megatron specs build unchanged.
    `stride` is Megatron's (equal blocks of the output split over TP each) or, here, the sizes of unequal
    blocks (each a multiple of p) for a fused projection (`set_tensor_model_parallel_attributes`).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method,
        bias: bool = True,
        gather_output: bool = False,
        stride: int | tuple[int, ...] = 1,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer=None,
        grad_output_buffer=None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group=None,
    ):
        super().__init__()
        reject_unsupported(
            "ColumnParallelLinear",
            is_expert=is_expert,
            disable_grad_reduce=disable_grad_reduce,
            embedding_activation_buffer=embedding_activation_buffer is not None,
            grad_output_buffer=grad_output_buffer is not None,
        )
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.config, self.tp_group = config, tp_group
        self.sequence_parallel = config.sequence_parallel
        rank, world_size = _tp_rank_and_size(tp_group)
        self.tp_rank, self.tp_world_size = rank, world_size
        _check_last_rank_not_empty(output_size, world_size, "ColumnParallelLinear output_size")
        uneven = [size for size in partition_blocks(output_size, stride) if size % world_size]
        if isinstance(stride, (tuple, list)) and uneven:
            raise ValueError(f"ColumnParallelLinear output blocks {tuple(stride)}: {uneven} do not split evenly over "
                             f"{world_size} tensor-parallel ranks")
        self.output_size_per_partition = partition_size(output_size, rank, world_size)

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = _empty_weight(self.output_size_per_partition, input_size, config)
            initialize_affine_weight(
                self.weight, (output_size, input_size), 0, init_method, stride, config, rank, world_size
            )
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, config)
            set_tensor_model_parallel_attributes(self.bias, world_size > 1, 0, stride)
        else:
            self.register_parameter("bias", None)
        _prepare_fp8(self)

    def _apply(self, fn, recurse=True):
        return apply_keeping_fp8_weight(self, super()._apply, fn, recurse)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        """`weight` replaces the layer's own (a tied output layer passes the embedding weight)."""
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear built with skip_weight_param_allocation needs forward(weight=...)"
                )
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"ColumnParallelLinear: weight of shape {tuple(weight.shape)} passed, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        bias = None if self.skip_bias_add else self.bias
        communication = _communicating_gemm(self, input_)
        own_weight = weight is self.weight  # not a tied, passed-in weight
        if communication is not None:
            output = column_parallel_linear(
                input_, weight, bias, **communication, sequence_parallel=self.sequence_parallel,
                accumulate=own_weight and _accumulates(self, weight),
            )
        else:
            if self.sequence_parallel:
                input_parallel = gather_from_sequence_parallel_region(input_, group=self.tp_group)
            else:
                input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            if own_weight:
                output = _local_gemm(self, input_parallel, weight, bias)
            else:
                output = F.linear(input_parallel, weight, bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output, self.output_size, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """Y = sum_i X_i A_i + b with A split by input rows; returns `(output, bias if skip_bias_add else None)`.

    Input [s, b, in/p] (`input_is_parallel`) or [s, b, in] (scattered here); the partial products are
    all-reduced to [s, b, out], or reduce-scattered to [s/p, b, out] with sequence parallelism. The bias
    is replicated and added after the reduction. `tp_comm_buffer_name` is accepted as in
    `ColumnParallelLinear`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
    ):
        super().__init__()
        reject_unsupported("RowParallelLinear", is_expert=is_expert)
        if config.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.config, self.tp_group = config, tp_group
        self.sequence_parallel = config.sequence_parallel
        rank, world_size = _tp_rank_and_size(tp_group)
        self.tp_rank, self.tp_world_size = rank, world_size
        _check_last_rank_not_empty(input_size, world_size, "RowParallelLinear input_size")
        self.input_size_per_partition = partition_size(input_size, rank, world_size)
        self.weight = _empty_weight(output_size, self.input_size_per_partition, config)
        initialize_affine_weight(
            self.weight, (output_size, input_size), 1, init_method, stride, config, rank, world_size
        )
        if bias:
            self.bias = _zero_bias(output_size, config)
            # With sequence parallelism each rank sees only its part of the sequence, so the bias grads
            # must be all-reduced over TP (done by finalize_model_grads for params marked so).
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        _prepare_fp8(self)

    def _apply(self, fn, recurse=True):
        return apply_keeping_fp8_weight(self, super()._apply, fn, recurse)

    def forward(self, input_: torch.Tensor):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # At TP = 1 the bias can go into the GEMM; otherwise it must be added once, after the reduction.
        fuse_bias = self.tp_world_size == 1 and not self.skip_bias_add
        communication = _communicating_gemm(self, input_parallel) if self.sequence_parallel else None
        if communication is not None:
            output = row_parallel_linear_reduce_scatter(
                input_parallel, self.weight, **communication, accumulate=_accumulates(self, self.weight)
            )
        else:
            output = _local_gemm(self, input_parallel, self.weight, self.bias if fuse_bias else None)
            if self.sequence_parallel:
                output = reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
            else:
                output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None and not fuse_bias:
            output = output + self.bias
        return output, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows over the TP ranks.

    Each rank looks up the ids it owns (others give zero rows) and the partial results are summed over
    TP: [b, s] ids -> [b, s, h], or, with `reduce_scatter_embeddings`, [s/p, b, h] (sequence parallel).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings, self.tp_group = reduce_scatter_embeddings, tp_group
        rank, world_size = _tp_rank_and_size(tp_group)
        self.tp_world_size = world_size
        _check_last_rank_not_empty(num_embeddings, world_size, "VocabParallelEmbedding vocabulary")
        self.vocab_start_index, self.vocab_end_index = partition_range(num_embeddings, rank, world_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _empty_weight(self.num_embeddings_per_partition, embedding_dim, config)
        initialize_affine_weight(
            self.weight, (num_embeddings, embedding_dim), 0, init_method, 1, config, rank, world_size
        )
        self.deterministic_mode = config.deterministic_mode

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        # F.embedding's backward may accumulate the rows of repeated ids in any order; an index's backward
        # is index_put with accumulation, deterministic under torch.use_deterministic_algorithms.
        return self.weight[ids] if self.deterministic_mode else F.embedding(ids, self.weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_world_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            output = self._lookup(local_ids).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            output = self._lookup(input_)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(output.transpose(0, 1).contiguous(), group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
