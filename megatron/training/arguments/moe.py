"""Mixture-of-experts flags (Megatron-LM's `_add_moe_args`). Expert parallelism is in parallel.py."""

import argparse


def _add_moe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="moe")
    group.add_argument("--num-experts", type=int, default=None, help="Experts per MoE layer (unset: dense).")
    group.add_argument("--moe-layer-freq", type=str, default=1,
                       help='Every N-th layer is MoE, or a 0/1 pattern such as "([1]*3+[0]*1)*3".')
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="Hidden size of each expert (default --ffn-hidden-size).")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="Total hidden size of the shared experts (unset: none).")
    group.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                       choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing",
                                "none"],
                       help="Load-balancing strategy of the router.")
    group.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                       help="Coefficient of the load-balancing loss.")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Coefficient of the router z-loss.")
    group.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid", "sqrtsoftplus"],
                       help="Router score function.")
    group.add_argument("--moe-router-pre-softmax", action="store_true", help="Softmax before the top-k.")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="Aux-loss-free balancing with a learned expert bias.")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                       help="Update rate of the expert bias.")
    group.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"],
                       help="Token dispatcher.")
    group.add_argument("--moe-grouped-gemm", action="store_true", help="Run the local experts as one grouped GEMM.")
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="Expert capacity factor (unset: no token dropping).")
    group.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                       help="Which tokens are dropped above capacity.")
    group.add_argument("--moe-permute-fusion", action="store_true", help="Fuse the token permutation kernels.")
    return parser
