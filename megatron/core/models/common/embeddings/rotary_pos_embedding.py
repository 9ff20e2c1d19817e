"""Rotary position embedding (RoPE, Su et al. 2021) with Megatron-Core's options.

For head dimension pairs i (frequency theta_i = base^(-2i/d)) at position m, RoPE rotates each pair by
the angle m * theta_i. Pairs are (x_i, x_{i + d/2}) by default - "rotate half", the Hugging Face Llama
convention - or (x_{2i}, x_{2i+1}) with `rotary_interleaved` (RoFormer / Meta's original code).
`rotary_percent` < 1 rotates only the first d' = d * percent dimensions and passes the rest through.
`seq_len_interpolation_factor` k divides positions by k (linear scaling); `rope_scaling` applies the
Llama-3.1 frequency-dependent scaling (YaRN is in yarn_rotary_pos_embedding.py). Like Megatron-LM,
positions are 0..s-1 (position_ids are not used for RoPE).
"""

import math

import torch


def apply_llama3_scaling(
    inv_freq: torch.Tensor,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Llama-3.1 RoPE scaling: wavelengths longer than L/low_freq_factor are stretched by `factor`,
    those shorter than L/high_freq_factor are kept, and the band between is interpolated smoothly."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Produces the rotation angles [s, 1, 1, d'] for positions offset .. offset + s - 1."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
    ):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim < 2 or dim % 2:
            raise ValueError(
                f"rotary_percent {rotary_percent} of kv_channels {kv_channels} gives {dim} rotary dimensions; "
                "it must be a positive even number"
            )
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        on_gpu = torch.cuda.is_available() and not use_cpu_initialization
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        # A plain fp32 attribute, not a buffer: Float16Module's .half() must not round the frequencies.
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        if rope_scaling:
            self.inv_freq = apply_llama3_scaling(self.inv_freq, factor=rope_scaling_factor)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        if packed_seq:
            raise ValueError("RotaryEmbedding: packed sequences are not supported yet")
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, self.inv_freq)  # [s, d'/2]
        if self.rotary_interleaved:
            angles = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # [s, d']: t0 t0 t1 t1 ...
        else:
            angles = torch.cat((freqs, freqs), dim=-1)  # [s, d']: t0 t1 ... t0 t1 ...
        return angles[:, None, None, :]


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    """The partner of each dimension with the sign of a 90-degree rotation: (a, b) -> (-b, a)."""
    if not rotary_interleaved:
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config=None,
    rotary_interleaved: bool | None = None,
    mscale: float = 1.0,
    mla_rotary_interleaved: bool = False,
):
    """Rotates t [s, b, heads, d] by angles `freqs` [s, 1, 1, d']: x * cos + rotate_half(x) * sin on the
    first d' dimensions, cos and sin multiplied by `mscale` (YaRN's concentration factor). The interleaving
    comes from `config.rotary_interleaved` unless given.

    `mla_rotary_interleaved` (multi-latent attention, DeepSeek's checkpoints): the rotated part is first
    reordered from pairs (x_0, x_1), (x_2, x_3), ... into halves [x_0, x_2, ...; x_1, x_3, ...] and then
    rotated as halves; the result stays in that order. Queries and keys are reordered alike, so q.k is that of
    the rotation of the interleaved pairs."""
    if rotary_interleaved is None:
        rotary_interleaved = bool(config is not None and config.rotary_interleaved)
    freqs = freqs.to(t.device)
    rotary_dim = freqs.size(-1)
    t_rotary, t_pass = t[..., :rotary_dim], t[..., rotary_dim:]
    if mla_rotary_interleaved:
        t_rotary = torch.cat((t_rotary[..., 0::2], t_rotary[..., 1::2]), dim=-1)
    cos, sin = (freqs.cos() * mscale).to(t.dtype), (freqs.sin() * mscale).to(t.dtype)
    t_rotary = t_rotary * cos + _rotate_half(t_rotary, rotary_interleaved) * sin
    return torch.cat((t_rotary, t_pass), dim=-1) if t_pass.numel() else t_rotary
