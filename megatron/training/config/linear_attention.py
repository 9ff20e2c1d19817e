"""Linear-attention layers mixed with softmax attention (Megatron-LM's `experimental_attention_variant` group
and the TransformerConfig-generated `--linear-*` flags), as Qwen3-Next:

    --experimental-attention-variant gated_delta_net --linear-attention-freq 4 --linear-conv-kernel-dim 4
    --linear-key-head-dim 128 --linear-value-head-dim 128 --linear-num-key-heads 16 --linear-num-value-heads 32

makes layers 4, 8, ... (from 1) softmax attention and the others Gated DeltaNet (megatron/core/ssm). Their
rules against the layers and the parallel layout are Megatron-Core's (`linear_attention_problems`,
megatron/core/transformer/config_rules.py), run by megatron/training/arguments/validate_model.py.
"""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag
from megatron.training.config.moe import parse_layer_freq


@dataclass(kw_only=True)
class LinearAttentionConfig(Section):
    """Which layers use linear attention, and its shape."""

    TITLE = "experimental_attention_variant"

    experimental_attention_variant: str | None = flag(None, choices=("gdn", "gdn2", "dsa", "gated_delta_net"))
    """gated_delta_net (or gdn): Gated DeltaNet linear attention on the layers --linear-attention-freq picks
    (gdn2 and dsa are not supported yet)."""

    linear_attention_freq: int | str | list[int] | None = flag(None, type=str)
    """N: every N-th layer keeps softmax attention, the others are linear ((N-1):1); or a 0/1 pattern over the
    layers such as "([1]*3+[0]*1)*3", 1 = linear attention."""

    linear_conv_kernel_dim: int = 4
    """Width of the causal convolution over the linear attention's queries, keys and values."""

    linear_key_head_dim: int = 128
    """Query/key head width of the linear attention."""

    linear_value_head_dim: int = 128
    """Value (and output gate) head width of the linear attention."""

    linear_num_key_heads: int = 16
    """Query/key heads of the linear attention."""

    linear_num_value_heads: int = 32
    """Value heads of the linear attention (a multiple of the key heads)."""

    def derived(self) -> dict:
        """The pattern as the model reads it: an int or a 0/1 list (unparseable: None, reported by validate)."""
        try:
            return {"linear_attention_freq": parse_layer_freq(self.linear_attention_freq, "--linear-attention-freq")
                    if self.linear_attention_freq is not None else None}
        except ValueError:
            return {"linear_attention_freq": None}

    def validate(self) -> list[str]:
        if self.linear_attention_freq is None:
            return []
        try:
            parse_layer_freq(self.linear_attention_freq, "--linear-attention-freq")
        except ValueError as error:
            return [str(error)]
        return []
