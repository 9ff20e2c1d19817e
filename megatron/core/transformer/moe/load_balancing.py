"""The router's balancing terms (Megatron-Core's formulas), as pure functions of fp32 tensors.

Switch-Transformer load-balancing loss over T tokens, E experts, top-k routing:

    aux_loss = coeff * E / (k * T^2) * sum_i (sum_t p_t,i) * n_i
             = coeff * E * sum_i f_i * P_i,   f_i = n_i / (k T) (share of routed slots), P_i = mean_t p_t,i

with p the scores over all experts (softmax, or sigmoid normalised per token) and n_i the tokens whose
top-k (over those scores) contains expert i. It is minimal (= coeff) for uniform routing.
Z-loss (ST-MoE): coeff * mean_t logsumexp(logits_t)^2, which keeps the logits small.
Aux-loss-free balancing (DeepSeek-V3): bias_i += rate * sign(mean_j n_j - n_i) after every step.
"""

import torch


def switch_load_balancing_loss_func(
    probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int, topk: int, num_experts: int,
    moe_aux_loss_coeff: float,
) -> torch.Tensor:
    """probs [T_local, E'] (this rank's tokens), tokens_per_expert [E'] counted over all `total_num_tokens`
    tokens of the balancing domain; E' = E, or B*E for the per-sequence variant."""
    aggregated_probs_per_expert = probs.sum(dim=0)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """coeff * mean over tokens of logsumexp(logits)^2; logits [T, E]."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str):
    """(routing_map [T, E] bool, scores [T, E]) that the load-balancing loss sees: the scores over all
    experts and their plain top-k (no expert bias, no capacity)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


@torch.no_grad()
def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, update_rate: float):
    """expert_bias + rate * sign(mean load - load), row by row; tokens_per_expert [L, E] already summed
    over every rank that routes tokens."""
    average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average_tokens - tokens_per_expert) * update_rate
