"""Fine-grained activation offloading (megatron/core/transformer/activation_offload.py): with every module
offloaded (alone, with the selective recompute Megatron-LM's offloading test configurations use, with full
recompute) the loss and every gradient are exactly those without offloading, and each named module's saved
tensors really went through the hooks: copied out in forward, each copied back once in backward. On a GPU the
copies are pinned host memory."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.activation_offload import OFFLOAD_MODULES, ActivationOffload
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

VOCAB, SEQ = 64, 12
MODELS = {
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=True,
                add_bias_linear=False, num_query_groups=2),
    "mla_sequential_experts": dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
                                   qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, num_moe_experts=4,
                                   moe_router_topk=2, moe_ffn_hidden_size=16),
}
# The recompute of gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading (mla_up_proj with MLA only).
RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=["layernorm", "mlp", "moe_act"])


def _loss_and_grads(model_name, device="cpu", **settings):
    torch.manual_seed(0)
    extra = {**MODELS[model_name], **settings}
    config = (MLATransformerConfig if "multi_latent_attention" in extra else TransformerConfig)(
        num_layers=2, hidden_size=32, num_attention_heads=4, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.2, attention_dropout=0.2, use_cpu_initialization=True, **extra,
    )
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    qk_layernorm=config.qk_layernorm,
                                    multi_latent_attention=config.multi_latent_attention)
    model = GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope").to(device)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1)).to(device)
    model_parallel_cuda_manual_seed(42)
    loss = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}, model


def _offloads(model) -> dict:
    """{module name: [its ActivationOffload of each layer]}."""
    found = {}
    for module in model.modules():
        for offload in vars(module).values():
            if isinstance(offload, ActivationOffload):
                found.setdefault(offload.name, []).append(offload)
    return found


@pytest.mark.parametrize("model_name, recompute", [
    ("moe", {}),
    ("moe", RECOMPUTE),
    # Full recompute: what the recomputed layer saves in backward is used at once, not offloaded again.
    ("moe", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ("mla_sequential_experts", {"recompute_granularity": "selective",
                                "recompute_modules": ["layernorm", "mla_up_proj", "mlp"]}),
])
def test_offloading_changes_nothing_but_where_saved_tensors_wait(model_name, recompute):
    expected_loss, expected_grads, _ = _loss_and_grads(model_name, **recompute)
    loss, grads, model = _loss_and_grads(model_name, fine_grained_activation_offloading=True,
                                         offload_modules=list(OFFLOAD_MODULES), min_offloaded_tensor_size=1,
                                         **recompute)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=0, msg=name)
    offloads = _offloads(model)
    assert sorted(offloads) == sorted(OFFLOAD_MODULES)
    for name, per_layer in offloads.items():
        for offload in per_layer:
            assert offload.enabled and offload.offloaded > 0, name
            assert offload.reloaded == offload.offloaded, name


def test_only_the_named_modules_and_large_tensors_are_offloaded():
    _, _, model = _loss_and_grads("moe", fine_grained_activation_offloading=True,
                                  offload_modules=["core_attn", "attn_proj"], min_offloaded_tensor_size=1)
    counts = {name: sum(offload.offloaded for offload in per_layer) for name, per_layer in _offloads(model).items()}
    assert {name for name, count in counts.items() if count} == {"core_attn", "attn_proj"}
    # linear_proj saves its input [s, b, h] (the weight, a parameter, stays): one tensor per layer, 12 x 2 x 32.
    assert [offload.offloaded_bytes for offload in _offloads(model)["attn_proj"]] == [12 * 2 * 32 * 4] * 2
    _, _, model = _loss_and_grads("moe", fine_grained_activation_offloading=True,
                                  offload_modules=["core_attn", "attn_proj"], min_offloaded_tensor_size=12 * 2 * 32 + 1)
    assert sum(offload.offloaded for offload in _offloads(model)["attn_proj"]) == 0


@pytest.mark.parametrize("settings, message", [
    (dict(offload_modules=["attn_proj"]), "'attn_proj' needs 'core_attn'"),
    (dict(offload_modules=["qkv"]), "unknown offload_modules entry 'qkv'"),
    (dict(offload_modules=["fused_group_mlp"]), "fused grouped MLP"),
    (dict(offload_modules=[]), "needs offload_modules"),
    (dict(offload_modules=["moe_act"], recompute_granularity="selective", recompute_modules=["moe"]),
     "'moe' in recompute_modules"),
])
def test_megatron_rules(settings, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, fine_grained_activation_offloading=True,
                          **settings)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_copies_are_pinned_host_memory():
    expected_loss, expected_grads, _ = _loss_and_grads("moe", device="cuda", **RECOMPUTE)
    captured = []
    original = ActivationOffload._pack

    def pack(self, tensor):
        packed = original(self, tensor)
        if not isinstance(packed, torch.Tensor):
            captured.append(packed[1])
        return packed

    ActivationOffload._pack = pack
    try:
        loss, grads, _ = _loss_and_grads("moe", device="cuda", fine_grained_activation_offloading=True,
                                         offload_modules=list(OFFLOAD_MODULES), min_offloaded_tensor_size=1,
                                         fine_grained_offloading_max_inflight_offloads=1, **RECOMPUTE)
    finally:
        ActivationOffload._pack = original
    assert captured and all(host.device.type == "cpu" and host.is_pinned() for host in captured)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=0, msg=name)
