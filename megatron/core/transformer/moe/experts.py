"""The local experts of one MoE layer: E/ep MLPs, each split over the expert-TP ranks.

    expert e:  y = fc2(act(fc1(x)))       fc1 [f/etp, h] (GLU: [gate_r; up_r], 2f/etp rows), fc2 [h, f/etp]

With etp > 1 each rank returns a partial sum over its f/etp columns; the dispatcher's reduce-scatter
adds them up. The weights carry `allreduce=False`, so DDP reduces their gradients over the expert
data-parallel group instead of the data-parallel one.

Two modules with Megatron-Core's state-dict keys:
    SequentialMLP  experts.local_experts.{i}.linear_fc1.weight   one GEMM per expert
    GroupedMLP     experts.linear_fc1.weight{i}                   (TE's grouped keys) one grouped GEMM
               (`torch._grouped_mm`) on a GPU that has it, else the same loop
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
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
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
        shape = list(full_shape)
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
    """Holds one expert weight as `weight` (the key Megatron's SequentialMLP experts have)."""

    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight


class _ExpertMLP(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Parameter, fc2: torch.nn.Parameter):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _ExpertLinear(fc1), _ExpertLinear(fc2)


class SequentialMLP(MegatronModule):
    """Local experts as a list of MLPs, run one after the other: rows [N, h] grouped by expert
    (`tokens_per_expert` [E_local] on the CPU) -> [N, h] (a partial sum when etp > 1)."""

    def __init__(self, num_local_experts: int, config, local_expert_indices: list, submodules=None):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        pairs = ExpertWeights(config, num_local_experts, local_expert_indices).build()
        self.local_experts = torch.nn.ModuleList(_ExpertMLP(fc1, fc2) for fc1, fc2 in pairs)
        self.activation = expert_activation(config)

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        intermediate = grouped_linear(rows, fc1, tokens_per_expert, use_grouped_mm=False)
        return grouped_linear(self.activation(intermediate), fc2, tokens_per_expert, use_grouped_mm=False)


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
        self.num_local_experts = num_local_experts
        pairs = ExpertWeights(config, num_local_experts, local_expert_indices).build()
        self.linear_fc1 = _GroupedWeights([fc1 for fc1, _ in pairs])
        self.linear_fc2 = _GroupedWeights([fc2 for _, fc2 in pairs])
        self.activation = expert_activation(config)
        self.use_grouped_mm = True

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        intermediate = grouped_linear(rows, self.linear_fc1.weights(), tokens_per_expert, self.use_grouped_mm)
        return grouped_linear(
            self.activation(intermediate), self.linear_fc2.weights(), tokens_per_expert, self.use_grouped_mm
        )
