"""The Triton AdamW (megatron/core/fusions/fused_adamw.py) against torch's AdamW followed by the copy into
the bf16 model params, and with bf16 moments against fusions/adamw_reference.py's step.

On a GPU the kernel runs compiled; on a CPU with Triton installed the same kernel runs in Triton's
interpreter (TRITON_INTERPRET=1, set before Triton is imported, hence the subprocess). The interpreter
rounds fp32 -> bf16 by truncation where compiled Triton rounds to nearest even, so only the GPU test asks
for the bf16 copies to equal torch's rounding bit for bit.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.core.fusions.fused_adamw import FusedAdamW

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Shapes with tails that do not fill a block, one of several blocks, and an empty group.
SHAPES = ((37,), (128, 64), (5000,), (3, 4097), (1,))

CHECK = """
import copy

import torch
from megatron.core.fusions.fused_adamw import FusedAdamW


def check(device, exact_copy):
    torch.manual_seed(0)
    reference = [torch.randn(shape, device=device) for shape in {shapes}]
    main = [param.clone() for param in reference]
    model = [param.bfloat16() for param in main[:-1]]  # the last param is its own main param (fp32)

    def groups(params):
        return [
            {{"params": params[:2], "weight_decay": 0.1}},
            {{"params": params[2:], "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.99)}},
            {{"params": [], "weight_decay": 0.0}},
        ]

    torch_adamw = torch.optim.AdamW(groups(reference), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    optimizer = torch.optim.AdamW(groups(main), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    fused = FusedAdamW(optimizer)
    for step in range(4):
        grads = [torch.randn_like(param) for param in reference]
        grad_scale = torch.tensor([1.0 + step], device=device) if step % 2 else None
        for param, grad in zip(reference, grads):
            param.grad = grad / grad_scale if grad_scale is not None else grad.clone()
        for param, grad in zip(main, grads):  # persistent gradients, as a trainer's main_grad buffers
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.copy_(grad)
        if step == 2:  # a new schedule value reaches the kernel
            for group in torch_adamw.param_groups + optimizer.param_groups:
                group["lr"] *= 0.5
        torch_adamw.step()
        if step == 1:  # a step vetoed on the device changes nothing; the host count is taken back
            before = [param.clone() for param in main] + [copy.deepcopy(optimizer.state[param]) for param in main]
            fused.step(dict(zip(main, model)), grad_scale, skip=torch.ones(1, dtype=torch.int32, device=device))
            fused.rewind()
            after = [param.clone() for param in main] + [copy.deepcopy(optimizer.state[param]) for param in main]
            assert all(torch.equal(x, y) if torch.is_tensor(x) else
                       all(torch.equal(x[key], y[key]) for key in x) for x, y in zip(before, after))
        skip = torch.zeros(1, dtype=torch.int32, device=device) if step == 3 else None
        if skip is not None and device == "cuda":  # a verdict left on the device is never read by the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            fused.step(dict(zip(main, model)), grad_scale, skip=skip)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        for ours, theirs in zip(main, reference):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(optimizer.state[ours][key], torch_adamw.state[theirs][key],
                                           rtol=1e-5, atol=1e-7)
            assert float(optimizer.state[ours]["step"]) == float(torch_adamw.state[theirs]["step"]) == step + 1
        for model_copy, param in zip(model, main):
            if exact_copy:  # compiled Triton rounds to nearest even, as torch does
                assert torch.equal(model_copy, param.bfloat16())
            else:  # the interpreter truncates: one bf16 step at most
                torch.testing.assert_close(model_copy.float(), param, rtol=2**-7, atol=0.0)
    # A loaded checkpoint replaces the state tensors: the launch table follows.
    optimizer.load_state_dict(copy.deepcopy(torch_adamw.state_dict()))
    for param, theirs in zip(main, reference):
        param.data.copy_(theirs)
        param.grad = torch.ones_like(param)
        theirs.grad = torch.ones_like(theirs)
    torch_adamw.step()
    fused.step(dict(zip(main, model)))
    for ours, theirs in zip(main, reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
"""


# Moments in bf16 (and one in bf16, one in fp32), against fusions/adamw_reference.py. Before every step the
# reference takes the kernel's params and its moments widened to fp32, and keeps fp32 moments: it computes the
# exact fp32 values the kernel must store. bf16 moments must then be those values rounded to nearest even
# (compiled Triton, and torch's cast) or truncated (the interpreter): at least 99% of the elements bit for bit
# (the kernel's and torch's fp32 arithmetic may differ in the last bit, which can move a value across a
# rounding boundary; the wrong rounding mode would miss about half), and all within one bf16 step (2^-7
# relative) plus 1e-7 (the fp32 tolerance of the fp32 check above: (1 - beta1) is computed in fp32 in the
# kernel, in double by torch, which shows where g - m cancels).
CHECK_MOMENTS = """
import torch
from megatron.core.fusions.adamw_reference import adamw_step
from megatron.core.fusions.fused_adamw import FusedAdamW

BF16, FP32 = torch.bfloat16, torch.float32


def truncated(values):
    return (values.view(torch.int32) & -65536).view(torch.float32).bfloat16()


def compare(optimizer, reference, main, shadow, compiled):
    for ours, theirs in zip(main, shadow):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            kept, exact = optimizer.state[ours][key], reference.state[theirs][key]
            if kept.dtype == FP32:
                torch.testing.assert_close(kept, exact, rtol=1e-5, atol=1e-7)
                continue
            expected = exact.bfloat16() if compiled else truncated(exact)
            assert (kept == expected).float().mean() >= 0.99, (key, (kept == expected).float().mean())
            torch.testing.assert_close(kept.float(), exact, rtol=2**-7, atol=1e-7)


def check(device, compiled):
    torch.manual_seed(0)
    for exp_avg_dtype, exp_avg_sq_dtype in ((BF16, BF16), (BF16, FP32), (FP32, BF16)):
        main = [torch.randn(shape, device=device) for shape in {shapes}]
        model = [param.bfloat16() for param in main[:-1]]
        groups = lambda params: [{{"params": params[:2], "weight_decay": 0.1}},
                                 {{"params": params[2:], "weight_decay": 0.0, "lr": 3e-3}}]
        optimizer = torch.optim.AdamW(groups(main), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
        fused = FusedAdamW(optimizer, exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
        for step in range(4):
            if step == 3:  # a checkpoint load gave one param fp32 moments: two launches in one step
                state = optimizer.state[main[0]]
                state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].float(), state["exp_avg_sq"].float()
            shadow = [param.clone() for param in main]
            reference = torch.optim.AdamW(groups(shadow), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
            for ours, theirs in zip(main, shadow):
                if optimizer.state[ours]:
                    reference.state[theirs] = {{key: value.float().clone() for key, value in
                                                optimizer.state[ours].items()}}
                ours.grad = torch.randn_like(ours)
                theirs.grad = ours.grad.clone()
            grad_scale = torch.tensor([1.0 + step], device=device) if step % 2 else None
            adamw_step(reference, FP32, FP32, grad_scale)
            fused.step(dict(zip(main, model)), grad_scale)
            for param in main[1:]:
                assert optimizer.state[param]["exp_avg"].dtype == exp_avg_dtype
                assert optimizer.state[param]["exp_avg_sq"].dtype == exp_avg_sq_dtype
            compare(optimizer, reference, main, shadow, compiled)
"""

# bf16 and fp16 gradients (a bf16 grad buffer: --grad-reduce-in-bf16) are read into fp32: the same step, bit
# for bit, as on their fp32 copies, mixed dtypes in one step included (one launch per gradient dtype).
CHECK_GRAD_DTYPES = """
import torch
from megatron.core.fusions.fused_adamw import FusedAdamW


def check(device):
    torch.manual_seed(0)
    start = [torch.randn(shape, device=device) for shape in {shapes}]
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float16]
    runs = []
    for widened in (False, True):
        main = [param.clone() for param in start]
        model = [param.bfloat16() for param in main]
        optimizer = torch.optim.AdamW([{{"params": main[:2], "weight_decay": 0.1}}, {{"params": main[2:]}}],
                                      lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0)
        if not widened:
            for param in main:
                param.grad_dtype = None  # an fp32 tensor whose .grad is bf16/fp16
        runs.append((main, model, optimizer, FusedAdamW(optimizer)))
    for step in range(3):
        grads = [torch.randn_like(param).to(dtype) for param, dtype in zip(start, dtypes)]
        grad_scale = torch.tensor([2.0], device=device) if step == 1 else None
        for (main, model, optimizer, fused), widened in zip(runs, (False, True)):
            for param, grad in zip(main, grads):
                param.grad = grad.float() if widened else grad
            fused.step(dict(zip(main, model)), grad_scale)
        (ours, our_model, ours_optimizer, _), (theirs, their_model, their_optimizer, _) = runs
        for mine, other in zip(ours + our_model, theirs + their_model):
            assert torch.equal(mine, other)
        for mine, other in zip(ours, theirs):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours_optimizer.state[mine][key], their_optimizer.state[other][key])
"""


def _in_the_interpreter(program: str) -> None:
    environment = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on a CPU)")
def test_fused_adamw_equals_torch_adamw_in_the_triton_interpreter():
    _in_the_interpreter(CHECK.format(shapes=SHAPES) + "\ncheck('cpu', exact_copy=False)\n")


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on a CPU)")
def test_bf16_moments_equal_the_reference_step_in_the_triton_interpreter():
    _in_the_interpreter(CHECK_MOMENTS.format(shapes=SHAPES) + "\ncheck('cpu', compiled=False)\n")


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on a CPU)")
def test_bf16_and_fp16_gradients_give_the_step_of_their_fp32_copies_in_the_triton_interpreter():
    _in_the_interpreter(CHECK_GRAD_DTYPES.format(shapes=SHAPES) + "\ncheck('cpu')\n")


def _on_the_gpu(program: str, **options) -> None:
    namespace = {}
    exec(program, namespace)
    namespace["check"]("cuda", **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_adamw_equals_torch_adamw_on_the_gpu():
    _on_the_gpu(CHECK.format(shapes=SHAPES), exact_copy=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_moments_equal_the_reference_step_on_the_gpu():
    _on_the_gpu(CHECK_MOMENTS.format(shapes=SHAPES), compiled=True)


def test_supports_only_what_the_kernel_computes():
    params = [torch.nn.Parameter(torch.zeros(4))]
    assert not FusedAdamW.supports(torch.optim.AdamW(params, lr=1.0), params)  # CPU tensors
    assert not FusedAdamW.supports(torch.optim.SGD(params, lr=1.0), params)
    if torch.cuda.is_available() and HAS_TRITON:
        cuda = [torch.nn.Parameter(torch.zeros(4, device="cuda"))]
        assert FusedAdamW.supports(torch.optim.AdamW(cuda, lr=1.0), cuda)
        assert not FusedAdamW.supports(torch.optim.AdamW(cuda, lr=1.0, amsgrad=True), cuda)
        assert not FusedAdamW.supports(torch.optim.Adam(cuda, lr=1.0, weight_decay=0.1), cuda)  # L2, not AdamW
        assert FusedAdamW.supports(torch.optim.Adam(cuda, lr=1.0), cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_and_fp16_gradients_give_the_step_of_their_fp32_copies_on_the_gpu():
    _on_the_gpu(CHECK_GRAD_DTYPES.format(shapes=SHAPES))
