"""Muon (`--optimizer muon`): momentum SGD whose update of each weight matrix is orthogonalized, as Megatron-LM's
TensorParallelMuon (over emerging_optimizers 0.3, the version it pins). The other params (embeddings, the output
layer, every param that is not a matrix: norms, biases) are Adam's (`muon_param_groups`).

For a matrix W (the fp32 main param) with gradient G, learning rate lr and weight decay wd:

    W <- W - lr wd W                                (decoupled weight decay, first)
    M <- momentum M + (1 - momentum) G              (M: the state "momentum_buffer", zeros at first)
    U  = (1 - momentum) G + momentum M  if nesterov, else M
    W <- W - lr * extra_scale_factor * scale(rows, cols) * NS(U)

scale: spectral sqrt(max(rows, cols)); unit_rms_norm sqrt(rows / cols); shape_scaling sqrt(max(1, rows / cols)).
NS(X) orthogonalizes X with the Newton-Schulz iteration: X is transposed to be wide (rows <= cols), divided by
max(||X||_F, 1e-7), then for each (a, b, c) of the coefficient set (cycled; polar_express, cans and deepseekv4
repeat their last):

    A = X X^T,  B = b A + c A A,  X = a X + B X

With --muon-fp32-matmul-prec medium (the default) the iteration runs in bf16 (X rounded once after the
normalization, back to fp32 at the end); high keeps fp32 under torch's "high" matmul precision (TF32 on GPUs).

The fused QKV weight (`is_qkv`, --muon-no-split-qkv turns it off) [ng (q + k + v), h] is viewed as [ng, q + k + v, h]
and its query, key and value rows ([ng q, h], [ng k, h], [ng v, h]) are orthogonalized one by one.

Tensor parallelism (params with `tensor_model_parallel` split along `partition_dim`; the routed experts' over the
expert-TP group), --muon-tp-mode:
    duplicated  (default) the shards all-gathered into the whole matrix, orthogonalized, this rank's block kept:
                the update of one rank holding the whole matrix (row order within the gathered matrix does not
                matter: NS(P X) = P NS(X) for a permutation P)
    distributed the Gram matrices A summed over the group instead (X transposed to have the split dim as rows'
                partner: partition_dim 0 -> X^T); the same maths, other rounding
    blockwise   each shard orthogonalized on its own and scaled by its own shape: the update depends on TP
"""

import contextlib
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import parallel_state

# emerging_optimizers 0.3's coefficient sets (a, b, c) per Newton-Schulz step.
COEFFICIENT_SETS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("duplicated", "distributed", "blockwise")
MATMUL_PRECISIONS = ("medium", "high")
_NORM_EPS = 1e-7


def _coefficients(coefficient_type: str, steps: int) -> list:
    sets = COEFFICIENT_SETS[coefficient_type]
    if coefficient_type in _REPEAT_LAST:
        return [sets[min(step, len(sets) - 1)] for step in range(steps)]
    return [sets[step % len(sets)] for step in range(steps)]


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", bf16: bool = True,
                  transpose: Optional[bool] = None, group=None) -> torch.Tensor:
    """NS(x) of the module docstring for an fp32 matrix. `group`: x is one block of a matrix split along the
    dim that `transpose` turns into columns; its Frobenius norm and Gram matrices are summed over `group`."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    if group is None:
        X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=_NORM_EPS)
    else:
        squares = (x * x).sum()
        dist.all_reduce(squares, group=group)
        X = x / torch.sqrt(squares).clamp_min(_NORM_EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in _coefficients(coefficient_type, steps):
        A = X @ X.mT
        if group is not None:
            dist.all_reduce(A, group=group)
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a [rows, cols] matrix (module docstring)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1, rows / cols) ** 0.5
    raise ValueError(f"muon scale mode {mode!r} is not one of {', '.join(SCALE_MODES)}")


@contextlib.contextmanager
def _fp32_matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _tensor_parallel_group(param: torch.Tensor):
    """The group `param` is split over (None: not split): the expert-TP group for routed experts."""
    if not getattr(param, "tensor_model_parallel", False) or not parallel_state.model_parallel_is_initialized():
        return None
    expert = not getattr(param, "allreduce", True)
    group = (parallel_state.get_expert_tensor_parallel_group() if expert
             else parallel_state.get_tensor_model_parallel_group())
    return group if dist.get_world_size(group) > 1 else None


class TensorParallelMuon(torch.optim.Optimizer):
    """Muon on params that are matrices (module docstring). Param groups carry `lr`, `momentum` and
    `weight_decay` (the scheduler sets lr and weight decay); the rest is per optimizer."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, nesterov: bool = False,
                 split_qkv: bool = True, fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic",
                 num_ns_steps: int = 5, scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 tp_mode: str = "duplicated"):
        problems = muon_option_problems(fp32_matmul_prec, coefficient_type, num_ns_steps, scale_mode, tp_mode)
        if problems:
            raise ValueError("invalid Muon options: " + "; ".join(problems))
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.nesterov, self.split_qkv, self.fp32_matmul_prec = nesterov, split_qkv, fp32_matmul_prec
        self.coefficient_type, self.num_ns_steps = coefficient_type, num_ns_steps
        self.scale_mode, self.extra_scale_factor, self.tp_mode = scale_mode, extra_scale_factor, tp_mode

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TensorParallelMuon.step takes no closure")
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buffer = state["momentum_buffer"]
                if weight_decay != 0.0:
                    param.add_(param, alpha=-weight_decay * lr)
                buffer.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buffer, momentum) if self.nesterov else buffer
                param.add_(self.orthogonalize(param, update), alpha=-lr)

    def orthogonalize(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """scale x NS of `update` (the QKV parts one by one), TP as `tp_mode` says (module docstring)."""
        if update.ndim != 2:
            raise ValueError(f"Muon updates matrices only, got a param of shape {tuple(update.shape)}")
        split_shapes = getattr(param, "qkv_split_shapes", None) if self.split_qkv else None
        if not split_shapes:
            return self._scaled_orthogonalization(param, update)
        groups = update.size(0) // sum(split_shapes)
        parts = update.view(groups, sum(split_shapes), -1).split(split_shapes, dim=1)
        orthogonalized = [self._scaled_orthogonalization(param, part.reshape(-1, update.size(1)))
                          .view(groups, -1, update.size(1)) for part in parts]
        return torch.cat(orthogonalized, dim=1).view_as(update)

    def _scaled_orthogonalization(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        group = None if self.tp_mode == "blockwise" else _tensor_parallel_group(param)
        shape = list(update.shape)
        bf16 = self.fp32_matmul_prec == "medium"
        with _fp32_matmul_precision(self.fp32_matmul_prec):
            if group is None:
                orthogonal = newton_schulz(update, self.num_ns_steps, self.coefficient_type, bf16)
            elif self.tp_mode == "duplicated":
                dim, size = param.partition_dim, dist.get_world_size(group)
                shards = [torch.empty_like(update) for _ in range(size)]
                dist.all_gather(shards, update.contiguous(), group=group)
                whole = newton_schulz(torch.cat(shards, dim=dim), self.num_ns_steps, self.coefficient_type, bf16)
                orthogonal = whole.chunk(size, dim=dim)[dist.get_rank(group)]
            else:  # distributed
                orthogonal = newton_schulz(update, self.num_ns_steps, self.coefficient_type, bf16,
                                           transpose=param.partition_dim == 0, group=group)
        if group is not None:
            shape[param.partition_dim] *= dist.get_world_size(group)
        return orthogonal * muon_scale_factor(*shape, self.scale_mode) * self.extra_scale_factor


def muon_option_problems(fp32_matmul_prec: str, coefficient_type: str, num_ns_steps: int, scale_mode: str,
                         tp_mode: str) -> List[str]:
    """What is wrong with Muon's options (the flags --muon-fp32-matmul-prec, ... say the same)."""
    problems = []
    if fp32_matmul_prec not in MATMUL_PRECISIONS:
        problems.append(f"muon_fp32_matmul_prec (--muon-fp32-matmul-prec) {fp32_matmul_prec!r} is not one of "
                        f"{', '.join(MATMUL_PRECISIONS)} (torch has no 'low' fp32 matmul precision: Megatron-LM "
                        "fails on it at its first step)")
    if coefficient_type not in COEFFICIENT_SETS:
        problems.append(f"muon_coefficient_type (--muon-coefficient-type) {coefficient_type!r} is not one of "
                        f"{', '.join(COEFFICIENT_SETS)}")
    if num_ns_steps < 1:
        problems.append(f"muon_num_ns_steps (--muon-num-ns-steps) must be at least 1, got {num_ns_steps}")
    if scale_mode not in SCALE_MODES:
        problems.append(f"muon_scale_mode (--muon-scale-mode) {scale_mode!r} is not one of {', '.join(SCALE_MODES)}")
    if tp_mode not in TP_MODES:
        problems.append(f"muon_tp_mode (--muon-tp-mode) {tp_mode!r} is not one of {', '.join(TP_MODES)}")
    return problems


def is_muon_param(param: torch.nn.Parameter) -> bool:
    """Megatron-LM's rule: a matrix that is not the word embedding or the output layer."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def mark_qkv_params(model_chunks: list) -> None:
    """Gives each fused QKV weight its `qkv_split_shapes` [np/ng hn, (np/ng hn gates,) hn, hn] (its rows per query
    group), where its local rows are whole groups (Megatron-LM skips the split otherwise, e.g. fewer groups than
    TP ranks)."""
    for chunk in model_chunks:
        config = getattr(chunk, "config", None)
        for name, param in chunk.named_parameters():
            if not (param.requires_grad and name.endswith("linear_qkv.weight") and param.ndim == 2):
                continue
            queries = config.num_attention_heads // config.num_query_groups * config.kv_channels
            # With the output gate each group holds its queries' gates after them (attention.py's layout).
            gates = [queries] if getattr(config, "attention_output_gate", False) else []
            shapes = [queries, *gates, config.kv_channels, config.kv_channels]
            if param.size(0) % sum(shapes) == 0:
                param.qkv_split_shapes = shapes
