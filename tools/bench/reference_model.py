"""A plain PyTorch GPT (nanoGPT / litgpt style) that the throughput benchmark times next to ours.

It is the yardstick of the speed comparisons (docs/benchmarks.md): the same shape as the Megatron model
(pre-norm, fused QKV, SDPA causal attention, GELU MLP or SwiGLU, LayerNorm or RMSNorm, learned positions or
RoPE, tied or untied output), trained with fp32 parameters under bf16 autocast, fused AdamW and `torch.compile`.
Nothing of megatron is imported, so it measures what PyTorch alone gives for the shape.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ReferenceConfig:
    """Model shape; `ffn_hidden_size` is the width f of the MLP (SwiGLU has three f-wide GEMMs)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_query_groups: int | None = None
    swiglu: bool = False
    rmsnorm: bool = False
    rope: bool = False
    bias: bool = True
    tied_embeddings: bool = True
    rotary_base: float = 10000.0

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


def _norm(config: ReferenceConfig) -> nn.Module:
    return nn.RMSNorm(config.hidden_size, eps=1e-5) if config.rmsnorm else nn.LayerNorm(config.hidden_size, bias=config.bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention: x [B, heads, T, d], cos/sin [T, d]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.heads, self.groups = config.num_attention_heads, config.groups
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, (self.heads + 2 * self.groups) * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.groups, self.head_dim).transpose(1, 2)  # (B, ng, T, hs)
        v = v.view(B, T, self.groups, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.swiglu = config.swiglu
        width = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.fc1 = nn.Linear(config.hidden_size, width, bias=config.bias)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.norm1, self.attn = _norm(config), Attention(config)
        self.norm2, self.mlp = _norm(config), MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class ReferenceGPT(nn.Module):
    """tokens [B, T] -> mean cross entropy against targets [B, T]."""

    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = None if config.rope else nn.Embedding(config.seq_length, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm_f = _norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        if config.rope:
            head_dim = config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / config.rotary_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
            angles = torch.outer(torch.arange(config.seq_length).float(), inv_freq).repeat(1, 2)  # [T, hs]
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = tokens.size(1)
        x = self.wte(tokens)
        rope = None
        if self.config.rope:
            rope = (self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype))
        else:
            x = x + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.blocks:
            x = block(x, rope)
        logits = self.lm_head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def reference_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens, targets, device_type: str = "cuda"
) -> torch.Tensor:
    """One bf16-autocast forward/backward and AdamW update; returns the (device) loss."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = model(tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def build_reference(config: ReferenceConfig, device: torch.device, compile_model: bool = True):
    """(compiled model, fused AdamW) as the benchmark trains them; lr/betas/wd like the Megatron runs."""
    model = ReferenceGPT(config).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    return (torch.compile(model) if compile_model else model), optimizer
