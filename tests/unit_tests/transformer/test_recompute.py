"""Activation recompute (full uniform/block, selective core_attn/mlp/layernorm/moe_act/mla_up_proj) gives the
same loss and gradients as no recompute, with dropout on (so the RNG replay is exercised); the output-discarding
modules (layernorm, moe_act, mla_up_proj) free what they discard."""

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

VOCAB, SEQ = 64, 12


# Models with the parts the output-discarding modules recompute: grouped-GEMM experts, multi-latent attention.
MODELS = {
    "dense": {},
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=True,
                add_bias_linear=False),
    "mla": dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
                v_head_dim=6, qk_layernorm=True, num_query_groups=4),
}


def _model(attention_backend, model_name, **recompute):
    torch.manual_seed(0)
    extra = {"num_query_groups": 2, **MODELS[model_name]}
    config = (MLATransformerConfig if "multi_latent_attention" in extra else TransformerConfig)(
        num_layers=4, hidden_size=32, num_attention_heads=4, gated_linear_unit=True, activation_func=F.silu,
        hidden_dropout=0.2, attention_dropout=0.2, attention_backend=attention_backend, use_cpu_initialization=True,
        **extra, **recompute,
    )
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    qk_layernorm=config.qk_layernorm,
                                    multi_latent_attention=config.multi_latent_attention)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope")


def _loss_and_grads(attention_backend="auto", model_name="dense", **recompute):
    model = _model(attention_backend, model_name, **recompute)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    model_parallel_cuda_manual_seed(42)
    loss = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _without_recompute(attention_backend, model_name="dense"):
    return _loss_and_grads(attention_backend, model_name)


@pytest.mark.parametrize(
    "attention_backend, recompute",
    [
        ("auto", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
        ("auto", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)),
        ("auto", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
        ("auto", dict(recompute_granularity="selective")),
        ("unfused", dict(recompute_granularity="selective")),
        ("auto", dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])),
    ],
)
def test_recompute_matches_no_recompute(attention_backend, recompute):
    expected_loss, expected_grads = _without_recompute(attention_backend)
    loss, grads = _loss_and_grads(attention_backend, **recompute)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-7, msg=name)


# (model, modules, bytes each layer no longer keeps at least: the two norm outputs [s, b, h]; the experts'
# activation output [rows, f], rows = s x b x top-2; of the up projections' query, key and value, net of the
# latents the recompute keeps, at least a query's [s, b, n, 12]; fp32). The layers keep more than that less:
# what the recomputed functions saved for their own backward goes too.
DISCARDING = [
    ("dense", ["layernorm", "mlp"], 2 * SEQ * 2 * 32 * 4),
    ("moe", ["moe_act"], SEQ * 2 * 2 * 16 * 4),
    ("mla", ["mla_up_proj", "layernorm"], (2 * SEQ * 2 * 32 + SEQ * 2 * 4 * 12) * 4),
]


@pytest.mark.parametrize("model_name, modules, freed_per_layer", DISCARDING)
def test_output_discarding_recompute_matches_and_frees(model_name, modules, freed_per_layer):
    expected_loss, expected_grads = _without_recompute("auto", model_name)
    loss, grads = _loss_and_grads("auto", model_name, recompute_granularity="selective", recompute_modules=modules)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-7, msg=name)
    others = [module for module in modules if module in ("core_attn", "mlp")]
    freed = _saved_bytes(model_name, others) - _saved_bytes(model_name, modules)
    assert freed >= 4 * freed_per_layer, (freed, 4 * freed_per_layer)  # 4 layers


def _saved_bytes(model_name, modules) -> int:
    """Bytes of the distinct storages the forward pass saves for backward (once the step's forward is done)."""
    extra = dict(recompute_granularity="selective", recompute_modules=modules) if modules else {}
    model = _model("auto", model_name, **extra)
    saved = []
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    model_parallel_cuda_manual_seed(42)
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean()
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage() for tensor in saved}
    return sum(storage.nbytes() for storage in storages.values())


def test_dropout_makes_the_check_meaningful():
    """Without the same RNG streams the losses differ, so equality above is not an accident."""
    loss, _ = _without_recompute("auto")
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.2, attention_dropout=0.2, use_cpu_initialization=True,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    model_parallel_cuda_manual_seed(43)
    other = model(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean()
    assert not torch.equal(loss, other.detach())
