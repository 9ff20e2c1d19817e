"""Gradient clipping folded into the fused Adam kernel (its `grad_scale`) updates the weights exactly as
`torch.nn.utils.clip_grad_norm_` followed by a plain AdamW step, and reports the same norm: a float from
`step()`, an unread 1-element tensor from `step_with_device_grad_norm()` (what pretrain()'s loop calls)."""

import pytest
import torch

from megatron.core.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params, OptimizerConfig


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)


def _grads(model, step, scale):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(param.shape, generator=generator) * scale for param in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [10.0, 1e-3])  # clipped, and below the threshold (no clipping)
@pytest.mark.parametrize("device_grad_norm", [False, True])
def test_clip_in_fused_adamw_equals_clip_then_adamw(dtype, scale, device_grad_norm):
    ours_model, reference_model = _model(dtype), _model(torch.float32)
    reference_model.load_state_dict({k: v.float() for k, v in ours_model.state_dict().items()})
    adam = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    config = OptimizerConfig(clip_grad=1.0, bf16=dtype == torch.bfloat16, lr=1e-2)
    inner = torch.optim.AdamW(list(ours_model.parameters()), fused=True, **adam)
    assert inner._step_supports_amp_scaling  # the path under test: clipping through grad_scale
    if dtype == torch.float32:
        ours = FP32Optimizer(inner, config)
    else:
        ours = Float16OptimizerWithFloat16Params(inner, config, None)
    reference = torch.optim.AdamW(reference_model.parameters(), foreach=False, **adam)
    for step in range(3):
        grads = _grads(ours_model, step, scale)
        for param, grad in zip(ours_model.parameters(), grads):
            param.main_grad = grad.clone()
        for param, grad in zip(reference_model.parameters(), grads):
            param.grad = grad.clone()
        ok, grad_norm, _ = ours.step_with_device_grad_norm() if device_grad_norm else ours.step()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 1.0).item()
        reference.step()
        assert ok and isinstance(grad_norm, torch.Tensor if device_grad_norm else float)
        assert float(grad_norm) == pytest.approx(expected_norm, rel=1e-5)
        assert not hasattr(inner, "grad_scale")
    main_params = [group["params"] for group in inner.param_groups][0]
    for mine, theirs in zip(main_params, reference_model.parameters()):
        torch.testing.assert_close(mine.detach().float(), theirs.detach(), atol=1e-6, rtol=1e-5)
