"""AdamW that also writes the bf16/fp16 model copy of every parameter, in one pass over memory (Triton).

Per element, in fp32, the update of `torch.optim.AdamW` (t = the step count after this step):

    g      = grad / grad_scale                    grad_scale: gradient clipping folded in (1 without)
    p      = p * (1 - lr * wd)
    m      = m + (1 - beta1) * (g - m)
    v      = beta2 * v + (1 - beta2) * g^2
    p      = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    model  = p rounded to the model's dtype          (only where the model param is a separate bf16/fp16 copy)

m and v are kept in fp32 or bf16 (`--exp-avg-dtype`, `--exp-avg-sq-dtype`), each on its own: read into fp32,
updated in fp32, stored back rounded to nearest even (adamw_reference.py has the same step in PyTorch). The
gradient may be fp32, bf16 or fp16 (a bf16 grad buffer, `--grad-reduce-in-bf16` / `--main-grads-dtype bf16`):
read into fp32, it gives the update of its fp32 copy bit for bit, without the copy (a pass over the gradients
and, for the 1.3B, 5 GB of fp32 tensors allocated every step).

Why: the mixed-precision step used to be torch's fused AdamW (read g, p, m, v; write p, m, v: 28 bytes per
parameter) followed by `_foreach_copy_` of the fp32 main params into the model params (6 more bytes, a
second pass). Here one kernel moves 30 bytes per parameter (22 with bf16 moments), and it reaches the copy
bandwidth because it walks large contiguous blocks: on a 1.3B-parameter model the optimizer is a fifth of a
training step.

Many tensors, one launch: the tensors stay where they are (the optimizer's state, DDP's grad buffer, the
model's params); a table gives each Triton program one block of `BLOCK` elements of one tensor, by the
tensors' data pointers. The table is rebuilt only when a pointer or a moment's dtype changes (a checkpoint
load replaces the optimizer state). The per-group hyper-parameters (lr, weight decay, betas, eps and the two bias
corrections) go to the GPU as one small tensor per step, so nothing waits for the host and no value is
read back.

`FusedAdamW.step` replaces `optimizer.step()` plus the main-to-model copy for a `torch.optim.AdamW`
without amsgrad/maximize; `FusedAdamW.supports` says when it applies (CUDA tensors, Triton installed, fp32
main params). Its references are torch's own AdamW followed by the copy, and with bf16 moments
adamw_reference.py's step (tests/unit_tests/optimizer/test_fused_adamw.py).
"""

import importlib.util
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .adamw_reference import MOMENT_DTYPES, is_decoupled, new_adam_state

_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
BLOCK = 1024  # elements per Triton program (1024 x 4 warps: 3.35 TB/s on an H200, 2048: 2.66)
NUM_WARPS = 4
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_FIELDS = 7  # lr, weight_decay, beta1, beta2, eps, lr / bias_correction1, sqrt(bias_correction2)

if _TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    # No argument may be called `params`, `options` or `specialization`: Triton's generated argument binder
    # has locals of those names (a kernel argument `params` arrives as a dict in Triton 3.6).
    @triton.jit
    def _adamw_kernel(
        block_tensor, block_start, numels, tensor_group, group_table, grad_scale, skip,
        grad_pointers, main_param_pointers, exp_avg_pointers, exp_avg_sq_pointers, model_param_pointers,
        HAS_GRAD_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, MODEL_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
        EXP_AVG_DTYPE: tl.constexpr, EXP_AVG_SQ_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        if HAS_SKIP:
            if tl.load(skip) != 0:  # the update was vetoed on the device (a bad step): write nothing
                return
        block = tl.program_id(0)
        tensor = tl.load(block_tensor + block)
        offsets = tl.load(block_start + block) + tl.arange(0, BLOCK_SIZE)
        mask = offsets < tl.load(numels + tensor)
        row = group_table + tl.load(tensor_group + tensor) * 7
        lr, weight_decay = tl.load(row), tl.load(row + 1)
        beta1, beta2, eps = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
        step_size, bias_correction2_sqrt = tl.load(row + 5), tl.load(row + 6)

        grad_pointer = tl.load(grad_pointers + tensor).to(tl.pointer_type(GRAD_DTYPE))
        param_pointer = tl.load(main_param_pointers + tensor).to(tl.pointer_type(tl.float32))
        exp_avg_pointer = tl.load(exp_avg_pointers + tensor).to(tl.pointer_type(EXP_AVG_DTYPE))
        exp_avg_sq_pointer = tl.load(exp_avg_sq_pointers + tensor).to(tl.pointer_type(EXP_AVG_SQ_DTYPE))
        grad = tl.load(grad_pointer + offsets, mask=mask, other=0.0).to(tl.float32)
        param = tl.load(param_pointer + offsets, mask=mask, other=0.0)
        exp_avg = tl.load(exp_avg_pointer + offsets, mask=mask, other=0.0).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_pointer + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_GRAD_SCALE:
            grad = grad / tl.load(grad_scale)

        param = param * (1.0 - lr * weight_decay)
        exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denominator = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - step_size * exp_avg / denominator

        tl.store(param_pointer + offsets, param, mask=mask)
        tl.store(exp_avg_pointer + offsets, exp_avg.to(EXP_AVG_DTYPE), mask=mask)
        tl.store(exp_avg_sq_pointer + offsets, exp_avg_sq.to(EXP_AVG_SQ_DTYPE), mask=mask)
        if MODEL_DTYPE is not None:
            model_pointer = tl.load(model_param_pointers + tensor).to(tl.pointer_type(MODEL_DTYPE))
            tl.store(model_pointer + offsets, param.to(MODEL_DTYPE), mask=mask)


class _LaunchTable:
    """Device tables of one launch: which tensor and offset each program works on, and the tensors'
    pointers, sizes and param groups."""

    def __init__(self, entries: List[Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           Optional[torch.Tensor]]], device: torch.device, block: int):
        groups, grads, params, exp_avgs, exp_avg_sqs, models, numels = [], [], [], [], [], [], []
        block_tensor, block_start = [], []
        for index, (group, param, grad, exp_avg, exp_avg_sq, model) in enumerate(entries):
            numel = param.numel()
            blocks = (numel + block - 1) // block
            block_tensor += [index] * blocks
            block_start += range(0, blocks * block, block)
            groups.append(group)
            numels.append(numel)
            for table, tensor in ((grads, grad), (params, param), (exp_avgs, exp_avg), (exp_avg_sqs, exp_avg_sq)):
                table.append(tensor.data_ptr())
            models.append(model.data_ptr() if model is not None else 0)

        def as_tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        self.num_blocks = len(block_tensor)
        self.block_tensor = as_tensor(block_tensor, torch.int32)
        self.block_start = as_tensor(block_start, torch.int64)
        self.numels = as_tensor(numels, torch.int64)
        self.tensor_group = as_tensor(groups, torch.int32)
        self.pointers = [as_tensor(table, torch.int64) for table in (grads, params, exp_avgs, exp_avg_sqs, models)]


_TRITON_DTYPES = {}
if _TRITON_AVAILABLE:
    _TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, None: None}


class FusedAdamW:
    """The update of a `torch.optim.AdamW` (its param groups, hyper-parameters and state) plus the copy of
    each fp32 main param into its model param, as one Triton launch per dtype combination (model copy,
    gradient, exp_avg, exp_avg_sq).

    The optimizer's state stays torch's (`exp_avg`, `exp_avg_sq`, a float32 `step` tensor per param, as
    torch's fused AdamW keeps it), so checkpoints and a later `optimizer.step()` see no difference. Moments
    this step creates are zeros of `exp_avg_dtype` / `exp_avg_sq_dtype` (fp32 or bf16); existing ones are
    updated in the dtype they have.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, block_size: int = BLOCK, num_warps: int = NUM_WARPS,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32):
        self.optimizer = optimizer
        self.block_size, self.num_warps = block_size, num_warps
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self._signature = None
        self._launches: Dict[Tuple[Optional[torch.dtype], torch.dtype, torch.dtype, torch.dtype], _LaunchTable] = {}
        self._step_tensors: List[torch.Tensor] = []
        self._group_steps: List[int] = []

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer, main_params: Sequence[torch.Tensor]) -> bool:
        """True when this kernel can run `optimizer`'s step: a torch AdamW (or Adam without weight decay,
        the same update) without amsgrad/maximize/differentiable, fp32 main params on CUDA, Triton present."""
        if not _TRITON_AVAILABLE or not isinstance(optimizer, torch.optim.Adam):
            return False
        decoupled = is_decoupled(optimizer)
        for group in optimizer.param_groups:
            if group["amsgrad"] or group["maximize"] or group.get("differentiable"):
                return False
            if not decoupled and group["weight_decay"] != 0.0:
                return False
        return bool(main_params) and all(p.is_cuda and p.dtype == torch.float32 for p in main_params)

    def _entries(self, model_of: Dict[torch.Tensor, Optional[torch.Tensor]]) -> list:
        """(group index, main param, grad, exp_avg, exp_avg_sq, model copy) for every param with a gradient,
        creating Adam state (zeros, step 0) where there is none yet."""
        entries = []
        for group_index, group in enumerate(self.optimizer.param_groups):
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.optimizer.state[param]
                if not state:
                    state.update(new_adam_state(param, self.exp_avg_dtype, self.exp_avg_sq_dtype))
                entries.append((group_index, param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                model_of.get(param)))
        return entries

    def _rebuild(self, entries: list) -> None:
        for _, param, grad, exp_avg, exp_avg_sq, _ in entries:
            for tensor, dtypes in ((grad, GRAD_DTYPES), (exp_avg, MOMENT_DTYPES), (exp_avg_sq, MOMENT_DTYPES)):
                if tensor.dtype not in dtypes or not tensor.is_contiguous() or tensor.shape != param.shape:
                    raise ValueError(
                        f"FusedAdamW needs contiguous fp32/bf16/fp16 gradients and fp32 or bf16 Adam moments shaped "
                        f"like the param {tuple(param.shape)}, got {tensor.dtype} {tuple(tensor.shape)}"
                    )
        device = entries[0][1].device
        by_dtype: Dict[Tuple[Optional[torch.dtype], torch.dtype, torch.dtype, torch.dtype], list] = {}
        for entry in entries:
            grad, exp_avg, exp_avg_sq, model = entry[2:]
            key = (None if model is None else model.dtype, grad.dtype, exp_avg.dtype, exp_avg_sq.dtype)
            by_dtype.setdefault(key, []).append(entry)
        self._launches = {dtype: _LaunchTable(group, device, self.block_size) for dtype, group in by_dtype.items()}
        self._step_tensors = [self.optimizer.state[entry[1]]["step"] for entry in entries]
        # Every param of a group is at the same step (torch increments them together); one read, here only.
        first_of_group = {}
        for entry in entries:
            first_of_group.setdefault(entry[0], entry[1])
        self._group_steps = [
            int(self.optimizer.state[first_of_group[index]]["step"]) if index in first_of_group else 0
            for index in range(len(self.optimizer.param_groups))
        ]

    def _group_table(self, device: torch.device) -> torch.Tensor:
        rows = []
        for group, step in zip(self.optimizer.param_groups, self._group_steps):
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            rows.append([lr, group["weight_decay"], beta1, beta2, group["eps"],
                         lr / (1.0 - beta1 ** step), (1.0 - beta2 ** step) ** 0.5])
        table = torch.tensor(rows, dtype=torch.float32)
        if device.type == "cuda":
            table = table.pin_memory()
        return table.to(device, non_blocking=True)

    @torch.no_grad()
    def step(self, model_of: Dict[torch.Tensor, Optional[torch.Tensor]],
             grad_scale: Optional[torch.Tensor] = None, skip: Optional[torch.Tensor] = None) -> None:
        """One AdamW step of every main param with a gradient, writing `model_of[main_param]` (a bf16/fp16
        tensor of the same shape, or None for params that are their own main param). `grad_scale`: a
        1-element fp32 tensor every gradient is divided by (gradient clipping), or None.

        `skip`: a 1-element int32 tensor on the device; when nonzero the step changes nothing (params, moments
        and the step counts stay), decided without the host. The host's own count of steps (for the bias
        corrections) advances regardless: call `rewind()` once the host knows the step was skipped."""
        entries = self._entries(model_of)
        if not entries:
            return
        signature = tuple(
            (group, param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
             0 if model is None else model.data_ptr(), grad.dtype, exp_avg.dtype, exp_avg_sq.dtype)
            for group, param, grad, exp_avg, exp_avg_sq, model in entries
        )
        if signature != self._signature:
            self._rebuild(entries)
            self._signature = signature
        self._group_steps = [step + 1 for step in self._group_steps]
        device = entries[0][1].device
        group_table = self._group_table(device)
        if skip is None:
            torch._foreach_add_(self._step_tensors, 1.0)
        else:
            # A list of tensors: given one 0-dim tensor, torch picks the Scalar overload and reads it on the host,
            # which waited for the whole forward and backward every step.
            increment = (1 - skip).float().reshape(())
            torch._foreach_add_(self._step_tensors, [increment] * len(self._step_tensors))
        for (model_dtype, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype), table in self._launches.items():
            _adamw_kernel[(table.num_blocks,)](
                table.block_tensor, table.block_start, table.numels, table.tensor_group, group_table,
                grad_scale if grad_scale is not None else group_table, skip if skip is not None else group_table,
                *table.pointers, HAS_GRAD_SCALE=grad_scale is not None, HAS_SKIP=skip is not None,
                MODEL_DTYPE=_TRITON_DTYPES[model_dtype], GRAD_DTYPE=_TRITON_DTYPES[grad_dtype],
                EXP_AVG_DTYPE=_TRITON_DTYPES[exp_avg_dtype], EXP_AVG_SQ_DTYPE=_TRITON_DTYPES[exp_avg_sq_dtype],
                BLOCK_SIZE=self.block_size,
                num_warps=self.num_warps,
            )

    def rewind(self) -> None:
        """Takes back the host's count of the last step, which `skip` turned into no step on the device."""
        self._group_steps = [step - 1 for step in self._group_steps]
