"""Mixture-of-experts flags (Megatron-LM's `_add_moe_args`) and Megatron's parsing of `--moe-layer-freq`.
Expert parallelism is in parallel.py.

    --moe-layer-freq 2                    every 2nd layer is MoE (layers 0, 2, 4, ...)
    --moe-layer-freq "([1]*3+[0]*1)*3"    one 0/1 entry per layer (Megatron evaluates this list syntax)
"""

import ast
import re
from dataclasses import dataclass

from megatron.training.config.fields import Section, flag

_LIST_EXPRESSION = re.compile(r"^[\[\]\d\s,*+()]+$")


def _evaluate_list_expression(node):
    """Evaluates list literals, ints, `+` (concatenation) and `*` (repetition) only."""
    if isinstance(node, ast.Expression):
        return _evaluate_list_expression(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate_list_expression(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_list_expression(node.left), _evaluate_list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("unsupported expression")


def parse_layer_freq(value, flag_name: str = "--moe-layer-freq"):
    """`--moe-layer-freq` (or `flag_name`, e.g. --linear-attention-freq) as an int (every N-th layer) or a list
    of 0/1; raises ValueError on anything else."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    if _LIST_EXPRESSION.match(text):
        try:
            pattern = _evaluate_list_expression(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError, TypeError):
            pattern = None
        if isinstance(pattern, list):
            return pattern
    raise ValueError(f'{flag_name} {value!r} must be an integer or a 0/1 list such as "([1]*3+[0]*1)*3"')


def _single(value):
    """A one-element list of a nargs="+" flag as its element (combining several is not supported yet)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


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

    moe_shared_expert_gate: bool = False
    """Gate the shared experts' output per token by sigmoid(x . w), w a learned [1, hidden] (Qwen-MoE)."""

    moe_router_topk: int = 2
    """Experts per token."""

    moe_router_num_groups: int | None = None
    """Group-limited routing: number of equal expert groups."""

    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may use."""

    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the routing weights of the chosen experts."""

    moe_router_dtype: str | None = flag(None, choices=("fp32", "fp64"))
    """Router precision (this router always computes in fp32; fp64 is not supported yet)."""

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

    overlap_moe_expert_parallel_comm: bool = False
    """Megatron-LM: overlap the expert-parallel all-to-alls with the computation of another microbatch. Here
    they are not overlapped (the same results)."""

    moe_permute_fusion: bool = False
    """Fuse the token permutation kernels."""

    moe_router_fusion: bool = False
    """Megatron-LM: compute the router's top-k and auxiliary loss with Transformer Engine's fused kernels.
    Here the router runs plain torch operations (the same values)."""

    delay_wgrad_compute: bool = False
    """Megatron-LM: delay the experts' weight-gradient GEMMs so that they overlap the expert-parallel
    all-to-alls (with --overlap-moe-expert-parallel-comm). Here they run in each backward pass (the same
    gradients)."""

    @property
    def effective_num_experts(self) -> int | None:
        """--num-experts, with 0 meaning dense (None), as in Megatron."""
        return self.num_experts or None

    def derived(self) -> dict:
        """The flags as the model reads them: one load-balancing type and coefficient, the parsed layer
        pattern (unparseable: 1, reported by validate), 0 experts as None."""
        try:
            layer_freq = parse_layer_freq(self.moe_layer_freq)
        except ValueError:
            layer_freq = 1
        return {"num_experts": self.effective_num_experts, "moe_layer_freq": layer_freq,
                "moe_router_load_balancing_type": _single(self.moe_router_load_balancing_type),
                "moe_aux_loss_coeff": _single(self.moe_aux_loss_coeff)}

    def validate(self) -> list[str]:
        problems = []
        for flag_name, value in (("--moe-router-load-balancing-type", self.moe_router_load_balancing_type),
                                 ("--moe-aux-loss-coeff", self.moe_aux_loss_coeff)):
            if isinstance(value, list) and len(value) != 1:
                problems.append(f"{flag_name} {' '.join(map(str, value))}: combining several load-balancing losses "
                                "is not supported yet; give one")
        try:
            parse_layer_freq(self.moe_layer_freq)
        except ValueError as error:
            problems.append(str(error))
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            problems.append("--moe-shared-expert-gate needs shared experts (--moe-shared-expert-intermediate-size)")
        if self.moe_router_dtype == "fp64":
            problems.append("--moe-router-dtype fp64 is not supported yet; the router computes in fp32 "
                            "(--moe-router-dtype fp32)")
        experts = self.effective_num_experts
        if experts is None:
            return problems
        if not 1 <= self.moe_router_topk <= experts:
            problems.append(f"--moe-router-topk {self.moe_router_topk} must be between 1 and --num-experts {experts}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        return problems
