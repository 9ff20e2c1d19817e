"""Mixture-of-experts flags (Megatron-LM's `_add_moe_args`). Expert parallelism is in parallel.py."""

from dataclasses import dataclass

from megatron.training.config.fields import Section, flag


@dataclass(kw_only=True)
class MoEConfig(Section):
    """Experts, the router and the token dispatcher."""

    TITLE = "moe"

    num_experts: int | None = None
    """Experts per MoE layer (unset: dense)."""

    moe_layer_freq: int | str | list[int] = flag(1, type=str)
    """Every N-th layer is MoE, or a 0/1 pattern such as "([1]*3+[0]*1)*3"."""

    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert (default --ffn-hidden-size)."""

    moe_shared_expert_intermediate_size: int | None = None
    """Total hidden size of the shared experts (unset: none)."""

    moe_router_topk: int = 2
    """Experts per token."""

    moe_router_load_balancing_type: str | list[str] = flag(
        "aux_loss", nargs="+",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"))
    """Load-balancing strategy of the router."""

    moe_aux_loss_coeff: float | list[float] = flag(0.0, nargs="+", type=float)
    """Coefficient of the load-balancing loss."""

    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss."""

    moe_router_score_function: str = flag("softmax", choices=("softmax", "sigmoid", "sqrtsoftplus"))
    """Router score function."""

    moe_router_pre_softmax: bool = False
    """Softmax before the top-k."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing with a learned expert bias."""

    moe_router_bias_update_rate: float = 1e-3
    """Update rate of the expert bias."""

    moe_token_dispatcher_type: str = flag("allgather", choices=("allgather", "alltoall", "flex"))
    """Token dispatcher."""

    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM."""

    moe_expert_capacity_factor: float | None = None
    """Expert capacity factor (unset: no token dropping)."""

    moe_token_drop_policy: str = flag("probs", choices=("probs", "position"))
    """Which tokens are dropped above capacity."""

    moe_permute_fusion: bool = False
    """Fuse the token permutation kernels."""
