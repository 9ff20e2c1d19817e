"""`TopKRouter`: which k experts each token goes to, and with which weights.

    logits = x W^T                      x [T, h] (cast to fp32), W [E, h] -> [T, E], always in fp32
    softmax:          pre_softmax:  probs, idx = topk(softmax(logits), k)
                      otherwise:    top, idx = topk(logits, k);  probs = softmax(top)   (sums to 1)
    sigmoid:          s = sigmoid(logits);  idx = topk(s + expert_bias, k);  probs = s[idx] / sum s[idx] (k > 1)
    group-limited (G groups, g of them per token; DeepSeek-V3): the experts form G equal groups; a token's top-k
                      is taken over the experts of the g groups with the largest sums of their top-(k/g) scores
                      (the same scores the plain top-k would rank: logits, softmax or sigmoid + bias)
    scaling factor:   probs *= moe_router_topk_scaling_factor (DeepSeek-V3's routed_scaling_factor)
    sinkhorn:         idx = topk(Sinkhorn-balanced exp(logits), k) in training (load_balancing.py), probs the
                      sigmoid (k = 1) or softmax of the logits at idx; no load-balancing loss
    capacity (token dropping, factor c): each expert keeps at most ceil(k T / E * c) of this rank's T
    tokens, those with the highest probs ("probs") or the first ones ("position"); a dropped token's
    slot gets weight 0, so the token passes through the layer on its residual only.

Returns probs [T, E] (0 where not routed) and routing_map [T, E] bool. During training the z-loss is
attached to the logits and the load-balancing loss to the probs (see moe_utils.MoEAuxLossAutoScaler).
Each tensor-parallel rank routes its own part of the tokens (the MoE layer splits them), so the
balancing statistics are summed over the TP group and the router weight's gradient too
(`sequence_parallel=True`, reduced in finalize_model_grads).
"""

import math

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import parameter_device
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.load_balancing import (
    compute_routing_scores_for_aux_loss,
    sinkhorn_routing,
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
from megatron.core.transformer.transformer_config import TransformerConfig


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ceil(num_tokens / num_experts * capacity_factor)."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def _drop_over_capacity(probs, routing_map, capacity: int, drop_policy: str):
    """Keeps at most `capacity` tokens per expert (column); probs/routing_map [T, E]."""
    if drop_policy == "position":
        keep = routing_map & (torch.cumsum(routing_map.int(), dim=0) <= capacity)
    else:
        capacity = min(capacity, probs.size(0))
        _, kept_tokens = torch.topk(probs, k=capacity, dim=0, sorted=False)  # [capacity, E]
        keep = routing_map & torch.zeros_like(routing_map).scatter(0, kept_tokens, True)
    return probs * keep, keep


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """(values, indices) [T, k] of the top-k of `scores` [T, E] among the experts of each token's `group_topk`
    best groups, a group scored by the sum of its top-(topk // group_topk) entries."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    chosen_groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def topk_routing_with_capacity(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    expert_bias: torch.Tensor | None = None,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
):
    """(probs [T, E], routing_map [T, E] bool) from fp32 logits [T, E] (see the module docstring)."""

    def top(scores):
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            probs_topk, top_indices = top(torch.softmax(logits, dim=-1))
        else:
            top_logits, top_indices = top(logits)
            probs_topk = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        _, top_indices = top(scores if expert_bias is None else scores + expert_bias)
        probs_topk = torch.gather(scores, 1, top_indices)
        if topk > 1:
            probs_topk = probs_topk / (probs_topk.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs_topk = probs_topk * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, top_indices, probs_topk)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    if capacity_factor is None:
        return probs, routing_map
    capacity = get_capacity(logits.size(0) * topk, logits.size(1), capacity_factor)
    return _drop_over_capacity(probs, routing_map, capacity, drop_policy)


def _is_recomputation() -> bool:
    """True while activation recompute replays this forward inside backward: the step's counts and
    logged losses were recorded by the first run already."""
    return torch._C._current_graph_task_id() != -1


class TopKRouter(MegatronModule):
    """Router of one MoE layer; state: `weight` [E, h] (fp32), with expert bias also `expert_bias` [E]."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.topk = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self.layer_number = None
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32, device=parameter_device(config))
        )
        if config.perform_initialization:
            # Replicated on every rank: drawn from the default generator, which all ranks seed alike.
            config.init_method(self.weight.data)
        self.tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        self.weight.sequence_parallel = self.tensor_parallel_size > 1
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            device = self.weight.device
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
        else:
            self.expert_bias = None

    def set_layer_number(self, layer_number: int) -> None:
        """Global 1-based layer number: the slot of this layer's losses in the logging tracker."""
        self.layer_number = layer_number

    def _sum_over_tensor_parallel(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel_size > 1:
            dist.all_reduce(tensor, group=parallel_state.get_tensor_and_context_parallel_group())
        return tensor

    def _attach(self, activation, loss, coeff, name):
        if self.layer_number is not None and not _is_recomputation():
            # Multi-token prediction layers follow the decoder's L layers in the tracker (numbers L + k).
            num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            save_to_aux_losses_tracker(name, loss / coeff, self.layer_number, num_layers)
        if self.config.calculate_per_token_loss:
            # finalize_model_grads divides every gradient by the global token count; undo it for this loss.
            loss = loss * activation.size(0)
        return MoEAuxLossAutoScaler.apply(activation, loss)

    def _apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if not coeff:
            return logits
        # Every TP rank holds the mean over its own tokens; the router grads are summed over TP.
        z_loss = z_loss_func(logits, coeff / self.tensor_parallel_size)
        return self._attach(logits, z_loss, coeff, "z_loss")

    def _apply_load_balancing_loss(self, probs, logits, seq_length: int, batch_size: int):
        balancing, coeff = self.config.moe_router_load_balancing_type, self.config.moe_aux_loss_coeff
        if balancing == "none" or not coeff:
            return probs
        routing_map, scores = compute_routing_scores_for_aux_loss(
            logits, self.topk, self.config.moe_router_score_function
        )
        if balancing == "seq_aux_loss":
            # Token t = s_i * b + b_i: [s, b*E] makes each (sequence, expert) pair its own column.
            scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
            num_tokens, divisor, name = seq_length * self.tensor_parallel_size, batch_size, "seq_load_balancing_loss"
        else:
            num_tokens, divisor, name = logits.size(0) * self.tensor_parallel_size, 1, "load_balancing_loss"
        tokens_per_expert = self._sum_over_tensor_parallel(routing_map.sum(dim=0).float())
        aux_loss = switch_load_balancing_loss_func(
            scores, tokens_per_expert, num_tokens, self.topk, self.num_experts, coeff
        ) / divisor
        return self._attach(probs, aux_loss, coeff, name)

    def forward(self, hidden_states: torch.Tensor, seq_length: int, batch_size: int):
        """hidden_states [T, h] with T = seq_length * batch_size (sequence-major) -> (probs, routing_map)."""
        if self.enable_expert_bias and self.expert_bias.dtype != torch.float32:
            # Float16Module casts buffers too; the bias must stay fp32 to keep moving by small steps.
            self.expert_bias.data = self.expert_bias.data.float()
            self.local_tokens_per_expert.data = self.local_tokens_per_expert.data.float()
        logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())  # [T, E]
        training = self.training and torch.is_grad_enabled()
        if training:
            logits = self._apply_z_loss(logits)
        if self.config.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = sinkhorn_routing(logits, self.topk, training)
            if self.config.moe_expert_capacity_factor is not None:
                capacity = get_capacity(logits.size(0) * self.topk, self.num_experts,
                                        self.config.moe_expert_capacity_factor)
                probs, routing_map = _drop_over_capacity(probs, routing_map, capacity,
                                                         self.config.moe_token_drop_policy)
        else:
            probs, routing_map = topk_routing_with_capacity(
                logits,
                self.topk,
                score_function=self.config.moe_router_score_function,
                use_pre_softmax=self.config.moe_router_pre_softmax,
                expert_bias=self.expert_bias,
                capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                num_groups=self.config.moe_router_num_groups,
                group_topk=self.config.moe_router_group_topk,
                scaling_factor=self.config.moe_router_topk_scaling_factor,
            )
        if training:
            if self.enable_expert_bias and not _is_recomputation():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
            probs = self._apply_load_balancing_loss(probs, logits, seq_length, batch_size)
        return probs, routing_map
