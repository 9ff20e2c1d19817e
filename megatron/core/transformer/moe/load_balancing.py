"""The router's balancing terms (Megatron-Core's formulas), as pure functions of fp32 tensors.

Switch-Transformer load-balancing loss over T tokens, E experts, top-k routing:

    aux_loss = coeff * E / (k * T^2) * sum_i (sum_t p_t,i) * n_i
             = coeff * E * sum_i f_i * P_i,   f_i = n_i / (k T) (share of routed slots), P_i = mean_t p_t,i

with p the scores over all experts (softmax, or sigmoid normalised per token) and n_i the tokens whose
top-k (over those scores) contains expert i. It is minimal (= coeff) for uniform routing.
Z-loss (ST-MoE): coeff * mean_t logsumexp(logits_t)^2, which keeps the logits small.
Aux-loss-free balancing (DeepSeek-V3): bias_i += rate * sign(mean_j n_j - n_i) after every step.
Sinkhorn balancing (BASE layers): in training the experts are the top-k of the doubly-normalised matrix

    P = diag(d0) exp(logits) diag(d1),   d0, d1 iterated until every expert gets 1/E of the mass
                                         and every token 1/T (mean change of d1 below 1e-4)

and the weights are sigmoid(logits) (k = 1) or softmax(logits) (k > 1) at those experts; in evaluation the
top-k of the weights themselves. No loss term: the assignment balances the load.
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


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """The doubly-normalised exp(cost) of the module docstring; cost [T, E] in fp32."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, float("inf"), d1
    while error > tol:
        d0 = 1.0 / (d0.size(0) * (torch.sum(d1 * cost, 1) + eps))
        d1 = 1.0 / (d1.size(0) * (torch.sum(d0.unsqueeze(1) * cost, 0) + eps))
        error = torch.mean(torch.abs(d1_old - d1)).item()
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool):
    """(probs [T, E], routing_map [T, E] bool) of Sinkhorn balancing (module docstring); logits [T, E] fp32."""
    weights = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1)
    with torch.no_grad():
        _, indices = torch.topk(sinkhorn(logits.detach()) if training else weights, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return weights * routing_map, routing_map


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
