"""Flags of DeepSeek-V3-style models: multi-latent attention with YaRN and multi-token prediction (Megatron-LM's
`_add_mla_args`, `--rope-type`, the `--yarn-*` flags and the TransformerConfig-generated
`--multi-latent-attention` and `--mtp-*` flags). The group-limited routing flags are in moe.py.

    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1

Departure: Megatron-LM applies `--yarn-original-max-position-embeddings`, `--yarn-beta-fast/slow` and
`--[no-]yarn-correction-range-round-to-int` to `--position-embedding-type yarn` only, so with multi-latent
attention they silently keep their defaults (4096, 32, 1, rounded); here they set the YaRN of multi-latent
attention (standard attention with YaRN is not supported yet).
"""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag


@dataclass(kw_only=True)
class MultiLatentAttentionConfig(Section):
    """Multi-latent attention: queries, keys and values made from low-rank latents, rotated by YaRN."""

    TITLE = "mla"

    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3): queries, keys and values from low-rank latents."""

    q_lora_rank: int | None = None
    """Rank of the query compression (unset: queries are projected directly)."""

    kv_lora_rank: int = 32
    """Rank of the key/value compression."""

    qk_head_dim: int = 128
    """Per-head query/key width without position (q head = qk-head-dim + qk-pos-emb-head-dim)."""

    qk_pos_emb_head_dim: int = 64
    """Per-head width of the rotated part."""

    v_head_dim: int = 128
    """Per-head value width."""

    rope_type: str | None = flag(None, choices=("rope", "yarn"))
    """RoPE of multi-latent attention (default yarn); standard attention takes rope only."""

    rotary_scaling_factor: float = 1.0
    """YaRN scaling factor."""

    mscale: float = 1.0
    """YaRN mscale of multi-latent attention."""

    mscale_all_dim: float = 0.0
    """YaRN mscale_all_dim of multi-latent attention (also scales the softmax)."""

    yarn_original_max_position_embeddings: int | None = None
    """YaRN: context length of the original model (default 4096)."""

    yarn_beta_fast: float | None = None
    """YaRN beta_fast (default 32)."""

    yarn_beta_slow: float | None = None
    """YaRN beta_slow (default 1)."""

    yarn_correction_range_round_to_int: bool | None = flag(None, off=("--no-yarn-correction-range-round-to-int",))
    """Round the YaRN correction range to integers (the default)."""

    cache_mla_latents: bool = False
    """Cache the latents in generation (not supported yet)."""

    mla_down_proj_fusion: bool = False
    """Accepted for compatibility: the down projections compute the same function either way."""

    def validate(self) -> list[str]:
        problems = []
        if self.cache_mla_latents:
            problems.append("--cache-mla-latents: caching the latents in generation is not supported yet")
        if not self.multi_latent_attention and self.rope_type == "yarn":
            problems.append("--rope-type yarn needs --multi-latent-attention (standard attention takes "
                            "--position-embedding-type rope)")
        return problems


@dataclass(kw_only=True)
class MultiTokenPredictionConfig(Section):
    """Multi-token prediction: extra layers on the last stage that predict tokens further ahead."""

    TITLE = "multi-token prediction"

    mtp_num_layers: int | None = None
    """Multi-token prediction depth (extra layers predicting 2, 3, ... tokens ahead)."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the mean multi-token-prediction loss."""

    def validate(self) -> list[str]:
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            return [f"--mtp-num-layers {self.mtp_num_layers} must be a positive integer"]
        return []
