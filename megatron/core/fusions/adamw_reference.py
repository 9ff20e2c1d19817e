"""Adam(W) with its moments stored in their own dtype (fp32 or bf16), in plain PyTorch: the reference of the
Triton kernel (fused_adamw.py) and the step of runs without it (a CPU) under
`--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`.

Per param, all arithmetic in fp32 (t = the step count after this step), as `torch.optim.AdamW`:

    g = grad / grad_scale                            (grad_scale: gradient clipping folded in; 1 without)
    g = g + wd * p                                   (Adam with L2 regularisation only)
    p = p * (1 - lr * wd)                            (AdamW only)
    m = m + (1 - beta1) * (g - m)                    m read from its dtype into fp32
    v = beta2 * v + (1 - beta2) * g^2                v likewise
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    m, v stored back in their dtype                  bf16: rounded to nearest even, every step

The update uses the fp32 m and v of this step; only what is kept for the next step is rounded (as
Transformer Engine's FusedAdam does with `exp_avg_dtype=torch.bfloat16`). With fp32 moments the operations
are torch's single-tensor AdamW's, in the same order, so the result is the same bit for bit.

Why not torch's AdamW: it keeps every state tensor in the dtype of its param (its `load_state_dict` casts
them there) and its kernels want one dtype per param, so it cannot hold bf16 moments beside fp32 params.
"""

from typing import Dict, Optional

import torch

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def new_adam_state(param: torch.Tensor, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype,
                   step: float = 0.0) -> Dict[str, torch.Tensor]:
    """Adam's state of `param` before its first step (or at `step`, to be filled by a checkpoint load): zero
    moments in their dtypes and a float32 `step` tensor on the param's device, as torch's fused AdamW keeps it."""
    return {
        "step": torch.tensor(float(step), dtype=torch.float32, device=param.device),
        "exp_avg": torch.zeros_like(param, dtype=exp_avg_dtype, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, dtype=exp_avg_sq_dtype, memory_format=torch.preserve_format),
    }


def is_decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """AdamW (decoupled weight decay) rather than Adam with L2 regularisation."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay"))


@torch.no_grad()
def adamw_step(optimizer: torch.optim.Optimizer, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype,
               grad_scale: Optional[torch.Tensor] = None) -> None:
    """One step of a `torch.optim.Adam`/`AdamW` (its param groups, hyper-parameters and state) over every param
    with a gradient, the moments created (and kept) in `exp_avg_dtype` / `exp_avg_sq_dtype`. `grad_scale`: a
    1-element fp32 tensor every gradient is divided by, or None."""
    decoupled = is_decoupled(optimizer)
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("Adam with low-precision moments: amsgrad and maximize are not supported yet")
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = optimizer.state[param]
            if not state:
                state.update(new_adam_state(param, exp_avg_dtype, exp_avg_sq_dtype))
            state["step"] += 1
            step = float(state["step"])
            grad = param.grad.float()
            if grad_scale is not None:
                grad = grad / grad_scale
            if weight_decay != 0:
                if decoupled:
                    param.mul_(1 - lr * weight_decay)
                else:
                    grad = grad.add(param, alpha=weight_decay)
            # .float() of an fp32 tensor is the tensor itself: fp32 moments are updated in place.
            exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denominator = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))
            for key, value in zip(MOMENT_KEYS, (exp_avg, exp_avg_sq)):
                if state[key] is not value:
                    state[key].copy_(value)
