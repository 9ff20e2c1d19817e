"""Weights stored in FP8 (`--fp8-param-gather`) on one GPU: the same training as with bf16 weights, in less memory.

A GPT of 4 layers (hidden 512, SwiGLU FFN 2048) trains 3 steps with the distributed optimizer, with and without
FP8 weights, for each recipe. The losses agree within 1e-3 relative (the casts give the same bytes as the bf16
run's quantizations, so they are expected bitwise; cuBLAS may still pick another algorithm for an operand at
another address). Memory: after setup the model, buffers and optimizer take at least 0.9 byte per FP8 weight
element less (the param buffer holds 1 byte instead of 2; grads and main params are the same), and the peak
of the steps above that at least 0.5 byte less again (no per-step q_W of 1 byte: the weight is its own;
activations and the optimizer's transients are small at this size).
"""

import gc

import pytest
import torch

from tests.unit_tests.distributed.conftest import single_rank_groups  # noqa: F401 (the one-rank gloo fixture)
from tests.unit_tests.fp8.test_fp8_params import TENSORWISE, _train
from tests.unit_tests.fp8.test_fp8_model import _model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU of compute capability 8.9+"),
]

SIZE = dict(num_layers=4, hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, num_query_groups=4,
            calculate_per_token_loss=True)


def _run(fp8_param: bool, recipe: dict):
    """(losses, bytes allocated by setup, peak bytes of the steps above setup, FP8 weight elements)."""
    module = _model(fp8_param=fp8_param, **SIZE, **recipe)  # on the CPU, then moved (FP8 weights as bytes)
    fp8_elements = sum(linear.weight.numel() for linear in module.modules() if getattr(linear, "fp8", None) is not None)
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    module.cuda()
    torch.cuda.reset_peak_memory_stats()
    losses, model, optimizer = _train(module)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # What setup holds, measured after training: the Adam moments exist from the first step on in both runs.
    setup = torch.cuda.memory_allocated() - start
    del model, optimizer, module
    return losses, setup, peak - start - setup, fp8_elements


@pytest.mark.parametrize("recipe", [{}, TENSORWISE], ids=["delayed", "tensorwise"])
def test_fp8_weights_train_as_bf16_weights_in_less_memory(single_rank_groups, recipe):  # noqa: F811
    torch.cuda.set_device(0)
    bf16_losses, bf16_setup, bf16_peak, _ = _run(False, recipe)
    fp8_losses, fp8_setup, fp8_peak, fp8_elements = _run(True, recipe)
    assert fp8_losses == pytest.approx(bf16_losses, rel=1e-3)
    assert bf16_setup - fp8_setup >= 0.9 * fp8_elements
    assert bf16_peak - fp8_peak >= 0.5 * fp8_elements
