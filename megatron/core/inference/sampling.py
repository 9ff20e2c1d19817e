"""Choosing the next token from logits [b, V]: greedy, or sampling after temperature, top-k and top-p.

Filtered-out tokens get logit -inf, so that the softmax gives them probability 0 and the remaining
probabilities are renormalised: p_i = exp(l_i / T) / sum_{j kept} exp(l_j / T).
"""

import torch

from megatron.core.inference.sampling_params import SamplingParams


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keeps the `top_k` largest logits of each row [b, V] (ties with the k-th are kept too)."""
    top_k = min(top_k, logits.size(-1))
    kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [b, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps, per row [b, V], the smallest set of most likely tokens whose total probability is >= top_p.

    In descending order, token r is kept when the tokens ranked above it hold less than top_p: the
    most likely token is always kept, and so is the one whose probability crosses top_p.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [b, V], probability ranked above
    remove_sorted = mass_above >= top_p
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def sample_from_logits(
    logits: torch.Tensor,
    sampling_params: SamplingParams,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [b] from logits [b, V_pad].

    `vocab_size` drops the padded vocabulary rows (ids >= vocab_size are never chosen). `generator`
    (on the logits' device) makes the draws reproducible.
    """
    logits = logits.float()
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    if sampling_params.is_greedy:
        return torch.argmax(logits, dim=-1)
    logits = logits / sampling_params.temperature
    if sampling_params.top_k > 0:
        logits = filter_top_k(logits, sampling_params.top_k)
    if 0.0 < sampling_params.top_p < 1.0:
        logits = filter_top_p(logits, sampling_params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
