"""fused_vocab_parallel_cross_entropy against F.cross_entropy (loss and gradient), in several row chunks,
with label smoothing (Megatron's a' = a V/(V-1), which is F.cross_entropy's smoothing with a'), split over
two gloo TP ranks, and on the GPU from bf16 logits."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.fusions import fused_cross_entropy
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from tests.unit_tests.dist_utils import run_distributed

S, B, V = 9, 3, 24


def _inputs(device="cpu", dtype=torch.float32, shape=(S, B, V)):
    generator = torch.Generator(device).manual_seed(0)
    logits = (torch.randn(shape, device=device, generator=generator) * 3).to(dtype)
    return logits, torch.randint(0, shape[-1], shape[:2], device=device, generator=generator)


def _reference(logits, target, label_smoothing, weights):
    """(loss [s, b], d(sum loss*weights)/dlogits) from fp32 F.cross_entropy."""
    vocab = logits.size(-1)
    leaf = logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(leaf.view(-1, vocab), target.view(-1), reduction="none",
                           label_smoothing=label_smoothing * vocab / (vocab - 1)).view(target.shape)
    (loss * weights).sum().backward()
    return loss.detach(), leaf.grad


def _ours(logits, target, label_smoothing, weights):
    leaf = logits.detach().clone().requires_grad_(True)
    loss = fused_vocab_parallel_cross_entropy(leaf, target, label_smoothing)
    (loss * weights).sum().backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_elements", [2**27, 5 * V])  # one chunk; 5 rows per chunk (6 chunks, last short)
def test_matches_cross_entropy(label_smoothing, chunk_elements, monkeypatch):
    monkeypatch.setattr(fused_cross_entropy, "_CHUNK_ELEMENTS", chunk_elements)
    logits, target = _inputs()
    weights = torch.rand(S, B)
    loss, grad = _ours(logits, target, label_smoothing, weights)
    expected_loss, expected_grad = _reference(logits, target, label_smoothing, weights)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)


def test_bf16_logits_give_a_bf16_gradient_without_fp32_copies_kept():
    logits, target = _inputs(dtype=torch.bfloat16)
    loss, grad = _ours(logits, target, 0.0, torch.ones(S, B))
    expected_loss, expected_grad = _reference(logits, target, 0.0, torch.ones(S, B))
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.float(), expected_grad, atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_reuse_logits_writes_the_gradient_over_them(label_smoothing, monkeypatch):
    """Logits made by a layer for the loss alone (as the models' forward makes them): with reuse_logits the
    gradient that reaches the layer is the logits' own memory, and the layer's gradients are those of the
    default, which leaves the logits as they were. Several row chunks."""
    monkeypatch.setattr(fused_cross_entropy, "_CHUNK_ELEMENTS", 5 * V)
    hidden, target = torch.randn(S, B, 8), _inputs()[1]
    weights = torch.rand(S, B)
    results = []
    for reuse in (False, True):
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, V)
        logits = layer(hidden)
        before, seen = logits.detach().clone(), []
        logits.register_hook(lambda grad: seen.append(grad))
        loss = fused_vocab_parallel_cross_entropy(logits, target, label_smoothing, reuse_logits=reuse)
        (loss * weights).sum().backward()
        assert (seen[0].data_ptr() == logits.data_ptr()) == reuse
        assert torch.equal(logits.detach(), seen[0] if reuse else before)
        results.append((layer.weight.grad, layer.bias.grad, seen[0].clone()))
    for default, reused in zip(*results):
        assert torch.equal(default, reused)


def test_rejects_label_smoothing_out_of_range():
    logits, target = _inputs()
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        fused_vocab_parallel_cross_entropy(logits, target, 1.0)


def _tensor_parallel_check(rank, world_size):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    logits, target = _inputs()
    weights = torch.rand(S, B, generator=torch.Generator().manual_seed(1))
    width = V // world_size
    local = logits[..., rank * width : (rank + 1) * width]
    results = []
    for label_smoothing in (0.0, 0.1):
        loss, grad = _ours(local, target, label_smoothing, weights)
        expected_loss, expected_grad = _reference(logits, target, label_smoothing, weights)
        results.append((loss, grad, expected_loss, expected_grad[..., rank * width : (rank + 1) * width]))
    return results


def test_split_over_two_tensor_parallel_ranks():
    for rank_results in run_distributed(_tensor_parallel_check, 2):
        for loss, grad, expected_loss, expected_grad in rank_results:
            torch.testing.assert_close(loss, expected_loss)
            torch.testing.assert_close(grad, expected_grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(64, 2, 50304), (300, 1, 1000), (17, 3, 128256)])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_compiled_kernels_on_gpu(shape, label_smoothing, monkeypatch):
    monkeypatch.setattr(fused_cross_entropy, "_CHUNK_ELEMENTS", 2**22)  # several chunks for every shape
    logits, target = _inputs("cuda", torch.bfloat16, shape)
    weights = torch.rand(shape[:2], device="cuda")
    loss, grad = _ours(logits, target, label_smoothing, weights)
    expected_loss, expected_grad = _reference(logits, target, label_smoothing, weights)
    torch.testing.assert_close(loss, expected_loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad.float(), expected_grad, atol=1e-3, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reused_logits_on_gpu_give_the_default_gradient(monkeypatch):
    """The compiled gradient kernel writing over its own input chunk: bit for bit the default's gradient."""
    monkeypatch.setattr(fused_cross_entropy, "_CHUNK_ELEMENTS", 2**22)
    logits, target = _inputs("cuda", torch.bfloat16, (64, 2, 50304))
    weights = torch.rand(64, 2, device="cuda")
    grads = []
    for reuse in (False, True):
        leaf = logits.detach().clone().requires_grad_(True)
        logits_of_leaf = leaf * 1  # made for the loss alone, as the model's output layer makes them
        seen = []
        logits_of_leaf.register_hook(lambda grad: seen.append(grad))
        loss = fused_vocab_parallel_cross_entropy(logits_of_leaf, target, 0.1, reuse_logits=reuse)
        (loss * weights).sum().backward()
        assert (seen[0].data_ptr() == logits_of_leaf.data_ptr()) == reuse
        grads.append(leaf.grad)
    assert torch.equal(*grads)


def test_statistics_take_inductors_one_pass_softmax_pattern(monkeypatch):
    """The row max and sum of exponentials are spelled as Inductor's softmax pattern, which it turns into one
    pass over the row (online softmax, CUDA only: enabled here to see the match; the CPU lowering then stops)."""
    import torch._inductor.config as inductor_config
    post_grad = pytest.importorskip("torch._inductor.fx_passes.post_grad")
    if not hasattr(post_grad, "prepare_softmax_extra_check"):
        pytest.skip("this torch has no online-softmax pattern")
    from megatron.core.fusions.fused_cross_entropy import _chunk_statistics

    graphs = []
    monkeypatch.setattr(post_grad, "prepare_softmax_extra_check", lambda match: True)
    torch._dynamo.reset()
    # inductor's config through its own patch: after monkeypatch's undo the entry was gone from it
    with inductor_config.patch(post_grad_custom_post_pass=lambda graph: graphs.append(str(graph))):
        try:
            torch.compile(_chunk_statistics.eager)(torch.randn(16, 100), torch.randint(0, 100, (16,)), False)
        except Exception:  # the online-softmax lowering exists for Triton only
            pass
        finally:
            torch._dynamo.reset()
    assert graphs and "prepare_softmax_online" in graphs[0]
