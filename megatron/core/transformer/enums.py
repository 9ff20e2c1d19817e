"""Enums of the transformer layers (values as in Megatron-Core)."""

import enum


class LayerType(enum.Enum):
    """Kinds of layer a pipeline layout can place on a stage."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    """Self- or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Which mask attention applies.

    `causal`: each position sees itself and earlier ones; an explicit `attention_mask` given to the
    layer replaces the built-in causal mask (e.g. masks reset at document boundaries). `padding`: only
    the given mask. `no_mask`: nothing is masked.
    """

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


class AttnBackend(enum.Enum):
    """Core-attention implementation (`--attention-backend`).

    `auto`, `flash`, `fused`: `torch.nn.functional.scaled_dot_product_attention`; on CUDA `auto` tries its
    cuDNN, flash, memory-efficient and math kernels in that order, `flash` and `fused` pin its flash resp.
    cuDNN/memory-efficient kernels. `unfused`, `local`: the explicit
    softmax(QK^T/sqrt(d))V reference in `DotProductAttention`.
    """

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
