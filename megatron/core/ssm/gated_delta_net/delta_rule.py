"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh 2024) in pure PyTorch, chunked.

Per head, with the state S [dk, dv], queries q_t and keys k_t [dk] (L2-normalised by the caller, q_t also
scaled by 1/sqrt(dk) here), values v_t [dv], log-decay g_t <= 0 and write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t),   o_t = S_t^T q_t

(the state first decays, then the memory read at k_t is moved towards v_t by beta_t). The recurrence runs
in chunks of C positions. Inside a chunk, with G_i the cumulative sum of g over the chunk's positions 1..i
and S_0 the state at the chunk's start, every u_i follows from one unit lower-triangular solve:

    (I + A) U = diag(beta) V - diag(beta exp(G)) K S_0,   A_ij = beta_i exp(G_i - G_j) k_i . k_j  (j < i)
    o_i = exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T

so only the chunk-to-chunk state update is a loop (one step per C positions). This is the maths of
Megatron-LM's deterministic `torch_chunk_gated_delta_rule` and of Hugging Face's Qwen3-Next fallback (which
solve the triangular system row by row); positions past the sequence end are padded with g = 0, beta = 0,
which changes nothing. Everything is computed in fp32 and returned in the queries' dtype.
"""

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """query, key [b, s, h, dk], value [b, s, h, dv], g and beta [b, s, h] -> outputs [b, s, h, dv] (module
    docstring); the state starts at zero. `scale` defaults to 1/sqrt(dk)."""
    dtype, (batch, length, heads, dk), dv = query.dtype, key.shape, value.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    pad = (-length) % chunk_size
    # [b, s, h, d] -> [b, h, chunks, C, d]; [b, s, h] -> [b, h, chunks, C]
    query, key, value = (
        F.pad(x.transpose(1, 2).float(), (0, 0, 0, pad)).unflatten(2, (-1, chunk_size)) for x in (query, key, value)
    )
    g, beta = (F.pad(x.transpose(1, 2).float(), (0, pad)).unflatten(2, (-1, chunk_size)) for x in (g, beta))
    query = query * scale
    g = g.cumsum(dim=-1)  # G_i within each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=g.device).tril()
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    lower = beta.unsqueeze(-1) * (key @ key.transpose(-1, -2)) * decay
    right = torch.cat([beta.unsqueeze(-1) * value, (beta * g.exp()).unsqueeze(-1) * key], dim=-1)
    # The diagonal of `lower` is ignored: the system's matrix is I + A with A its strictly lower part.
    solved = torch.linalg.solve_triangular(lower, right, upper=False, unitriangular=True)
    written, read = solved.split([dv, dk], dim=-1)  # U = written - read @ S_0
    scores = (query @ key.transpose(-1, -2)) * decay
    to_end = (g[..., -1:] - g).exp().unsqueeze(-1)  # exp(G_C - G_j)
    state = query.new_zeros(batch, heads, dk, dv)
    outputs = []
    for chunk in range(query.size(2)):
        u = written[:, :, chunk] - read[:, :, chunk] @ state
        outputs.append((query[:, :, chunk] * g[:, :, chunk].exp().unsqueeze(-1)) @ state + scores[:, :, chunk] @ u)
        state = state * g[:, :, chunk, -1, None, None].exp() + (key[:, :, chunk] * to_end[:, :, chunk]).transpose(-1, -2) @ u
    output = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length]
    return output.transpose(1, 2).to(dtype)


def causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation) -> torch.Tensor:
    """x [b, s, c] through a causal depthwise convolution (weight [c, 1, K]: channel c's output at t mixes
    its inputs at t - K + 1 .. t, zeros before the start), then `activation`; -> [b, s, c]."""
    kernel = weight.size(-1)
    out = F.conv1d(x.transpose(1, 2), weight, bias, padding=kernel - 1, groups=weight.size(0))
    return activation(out[..., : x.size(1)]).transpose(1, 2)
