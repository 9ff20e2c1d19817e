"""The local experts of one MoE layer: E/ep MLPs, each split over the expert-TP ranks.

    expert e:  y = fc2(act(fc1(x) + b1)) + b2   fc1 [f/etp, h] (GLU: [gate_r; up_r], 2f/etp rows),
                                                fc2 [h, f/etp]; b1 [f/etp] split like fc1, b2 [h] whole

With etp > 1 each rank returns a partial sum over its f/etp columns; the dispatcher's reduce-scatter
adds them up (each rank adds b2 / etp, see `_BiasShare`). The params carry `allreduce=False`, so DDP
reduces their gradients over the expert data-parallel group instead of the data-parallel one.

Two modules with Megatron-Core's state-dict keys:
    SequentialMLP  experts.local_experts.{i}.linear_fc1.weight   one GEMM per expert; with
                   add_bias_linear also `.bias` (zero-initialised, as Megatron's linear layers)
    GroupedMLP     experts.linear_fc1.weight{i}                   (TE's grouped keys) one grouped GEMM
               (`torch._grouped_mm`) on a GPU that has it, else the same loop; no biases (as Megatron's)
Initialisation: with `use_cpu_initialization` every rank draws all E experts' full weights in expert
order from the CPU generator and keeps its own, so the model does not depend on ep or etp; otherwise
each rank draws its shards from the `expert-parallel-rng` stream.
"""

import contextlib

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.activations import openai_gelu
from megatron.core.tensor_parallel.layers import parameter_device, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.partition import partition_range
from megatron.core.tensor_parallel.random import (
    CheckpointWithoutOutput,
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.activation_offload import ActivationOffload
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.grouped_gemm import grouped_linear


def _expert_rng_region():
    tracker = get_cuda_rng_tracker()
    name = get_expert_parallel_rng_tracker_name()
    return tracker.fork(name) if name in tracker.states_ else contextlib.nullcontext()


def _shard(master: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of `master` along `dim`, each of `stride` blocks split separately ([gate; up])."""
    pieces = []
    for block in master.chunk(stride, dim=dim):
        start, end = partition_range(block.size(dim), rank, size)
        pieces.append(block.narrow(dim, start, end - start))
    return torch.cat(pieces, dim=dim)


class ExpertWeights:
    """Creates and initialises the fc1/fc2 weights of this rank's local experts (see module docstring)."""

    def __init__(self, config, num_local_experts: int, local_expert_indices: list):
        self.config = config
        self.num_local_experts, self.local_expert_indices = num_local_experts, local_expert_indices
        self.etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        self.etp_size = parallel_state.get_expert_tensor_parallel_world_size()
        glu = config.gated_linear_unit
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        # (full shape, split dim, stride, init method) of fc1 and fc2.
        self.layouts = (
            ((2 * ffn if glu else ffn, hidden), 0, 2 if glu else 1, config.init_method),
            ((hidden, ffn), 1, 1, config.output_layer_init_method),
        )

    def _empty(self, full_shape, dim) -> torch.nn.Parameter:
        """An uninitialised param of `full_shape` split over the ETP ranks along `dim` (None: whole)."""
        shape = list(full_shape)
        if dim is not None:
            shape[dim] //= self.etp_size
        return torch.nn.Parameter(
            torch.empty(shape, dtype=self.config.params_dtype, device=parameter_device(self.config))
        )

    def build(self) -> list:
        """[(fc1 weight, fc2 weight)] for the local experts, initialised."""
        weights = []
        for _ in range(self.num_local_experts):
            pair = tuple(self._empty(shape, dim) for shape, dim, _, _ in self.layouts)
            for weight, (_, dim, stride, _) in zip(pair, self.layouts):
                set_tensor_model_parallel_attributes(weight, self.etp_size > 1, dim, stride)
                weight.allreduce = False
            weights.append(pair)
        if self.config.perform_initialization:
            self._initialize(weights)
        return weights

    def build_biases(self) -> list:
        """[(b1 [2f/etp or f/etp], b2 [h])] for the local experts, zeros; b1 is split like fc1's rows."""
        biases = []
        for _ in range(self.num_local_experts):
            (fc1_shape, _, stride, _), (fc2_shape, _, _, _) = self.layouts
            fc1_bias, fc2_bias = self._empty(fc1_shape[:1], 0), self._empty(fc2_shape[:1], None)
            set_tensor_model_parallel_attributes(fc1_bias, self.etp_size > 1, 0, stride)
            set_tensor_model_parallel_attributes(fc2_bias, False, 0, 1)
            for bias in (fc1_bias, fc2_bias):
                bias.allreduce = False
                with torch.no_grad():
                    bias.zero_()
            biases.append((fc1_bias, fc2_bias))
        return biases

    @torch.no_grad()
    def _initialize(self, weights: list) -> None:
        if not self.config.use_cpu_initialization:
            with _expert_rng_region():
                for pair in weights:
                    for weight, (_, _, _, init_method) in zip(pair, self.layouts):
                        init_method(weight)
            return
        first = self.local_expert_indices[0]
        for expert in range(self.config.num_moe_experts):
            for which, (shape, dim, stride, init_method) in enumerate(self.layouts):
                master = torch.empty(shape, dtype=torch.float32)
                init_method(master)
                if first <= expert < first + self.num_local_experts:
                    shard = _shard(master.to(self.config.params_dtype), dim, stride, self.etp_rank, self.etp_size)
                    weights[expert - first][which].copy_(shard)


def expert_activation(config):
    """act(gate) * up for GLU (fc1 output [..., 2f] = [gate, up]), else act(x); Megatron's fused
    bias-GELU flag means the tanh approximation."""
    activation = config.activation_func
    if config.bias_activation_fusion and activation is F.gelu:
        activation = openai_gelu
    if not config.gated_linear_unit:
        return activation

    def glu(intermediate: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(intermediate, 2, dim=-1)
        return activation(gate) * up

    return glu


class _ExpertLinear(torch.nn.Module):
    """Holds one expert weight as `weight` (and `bias`), the keys Megatron's SequentialMLP experts have."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None):
        super().__init__()
        self.weight = weight
        self.bias = bias


class _ExpertMLP(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Parameter, fc2: torch.nn.Parameter, fc1_bias=None, fc2_bias=None):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _ExpertLinear(fc1, fc1_bias), _ExpertLinear(fc2, fc2_bias)


class _BiasShare(torch.autograd.Function):
    """rows + bias / etp: the etp ranks' partial sums add up to one b2. Every ETP rank receives the same
    output gradient (the backward of the combine's reduce-scatter is an all-gather), so giving `bias`
    the whole gradient keeps its etp copies equal, each with the gradient of the one bias they stand for."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, bias: torch.Tensor, etp_size: int):
        return rows + bias / etp_size

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, grad_output, None


class SequentialMLP(MegatronModule):
    """Local experts as a list of MLPs, run one after the other: rows [N, h] grouped by expert
    (`tokens_per_expert` [E_local] on the CPU) -> [N, h] (a partial sum when etp > 1)."""

    def __init__(self, num_local_experts: int, config, local_expert_indices: list, submodules=None):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        expert_weights = ExpertWeights(config, num_local_experts, local_expert_indices)
        pairs = expert_weights.build()
        biases = expert_weights.build_biases() if config.add_bias_linear else [(None, None)] * num_local_experts
        self.local_experts = torch.nn.ModuleList(
            _ExpertMLP(fc1, fc2, fc1_bias, fc2_bias) for (fc1, fc2), (fc1_bias, fc2_bias) in zip(pairs, biases)
        )
        self.activation = expert_activation(config)
        self.etp_size = expert_weights.etp_size
        self.fc1_offload, self.act_offload = ActivationOffload(config, "expert_fc1"), ActivationOffload(config, "moe_act")

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        fc1 = [expert.linear_fc1 for expert in self.local_experts]
        fc2 = [expert.linear_fc2 for expert in self.local_experts]
        with self.fc1_offload.scope():
            intermediate = grouped_linear(rows, [linear.weight for linear in fc1], tokens_per_expert, False)
            if self.config.add_bias_linear:
                intermediate = intermediate + _rows_of(fc1, tokens_per_expert)  # [N, f/etp]
        with self.act_offload.scope():
            activated = self.activation(intermediate)
        output = grouped_linear(activated, [linear.weight for linear in fc2], tokens_per_expert, False)
        if self.config.add_bias_linear:
            output = _BiasShare.apply(output, _rows_of(fc2, tokens_per_expert), self.etp_size)
        return output


def _rows_of(linears: list, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Each expert's bias repeated for its rows: [N, width]."""
    biases = torch.stack([linear.bias for linear in linears])  # [E_local, width]
    rows = int(tokens_per_expert.sum())  # known on the CPU: no device sync for the output size
    return torch.repeat_interleave(biases, tokens_per_expert.to(biases.device), dim=0, output_size=rows)


class _GroupedWeights(torch.nn.Module):
    """Holds expert i's weight as `weight{i}` (Transformer Engine's GroupedLinear keys)."""

    def __init__(self, weights: list):
        super().__init__()
        for index, weight in enumerate(weights):
            self.register_parameter(f"weight{index}", weight)

    def weights(self) -> list:
        return [getattr(self, f"weight{index}") for index in range(len(self._parameters))]


class GroupedMLP(MegatronModule):
    """Local experts computed with grouped GEMMs (`--moe-grouped-gemm`); same maths as SequentialMLP."""

    def __init__(self, num_local_experts: int, config, local_expert_indices: list, submodules=None):
        super().__init__(config)
        if config.add_bias_linear:
            raise ValueError("GroupedMLP (--moe-grouped-gemm) has no expert biases, as in Megatron-LM: set "
                             "add_bias_linear=False (--disable-bias-linear) or use SequentialMLP (no "
                             "--moe-grouped-gemm)")
        self.num_local_experts = num_local_experts
        pairs = ExpertWeights(config, num_local_experts, local_expert_indices).build()
        self.linear_fc1 = _GroupedWeights([fc1 for fc1, _ in pairs])
        self.linear_fc2 = _GroupedWeights([fc2 for _, fc2 in pairs])
        self.activation = expert_activation(config)
        self.use_grouped_mm = True
        # Selective recompute of "moe_act": the activation output is not kept past fc2 (recomputed in backward).
        self.recompute_activation = config.recompute_granularity == "selective" and "moe_act" in config.recompute_modules
        self.fc1_offload, self.act_offload = ActivationOffload(config, "expert_fc1"), ActivationOffload(config, "moe_act")

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        with self.fc1_offload.scope():
            intermediate = grouped_linear(rows, self.linear_fc1.weights(), tokens_per_expert, self.use_grouped_mm)
        recompute = None
        with self.act_offload.scope():
            if self.recompute_activation and self.training and torch.is_grad_enabled():
                recompute = CheckpointWithoutOutput()
                activated = recompute.checkpoint(self.activation, intermediate)
            else:
                activated = self.activation(intermediate)
        output = grouped_linear(activated, self.linear_fc2.weights(), tokens_per_expert, self.use_grouped_mm)
        if recompute is not None:
            recompute.discard_output_and_register_recompute(output)
        return output
