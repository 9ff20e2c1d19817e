"""Multi-token prediction against its definition written out step by step: with D = 2 depths, depth k feeds
[enorm(embedding(tokens shifted by k)); hnorm(h_{k-1})] through eh_proj, a transformer layer and a final
norm, and its cross entropy against the labels shifted by k (loss mask shifted alike) joins the loss as
mtp_loss_scaling_factor / D times its token mean. The model's gradient of the language-model loss (with the
MTP losses attached) must equal the gradient of that total, and the logged "mtp_k loss" values the token
means; a model without `labels` or with an inference context skips the depths.

Tolerance (fp32): gradients within 1e-6 of the largest entry, losses within 1e-6.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import mtp_losses_for_logging, roll_tensor
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH, DEPTHS, FACTOR = 48, 12, 3, 2, 0.3


def _model() -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=32, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR,
    )
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), VOCAB, SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=True)


def _batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.3).float()
    return tokens[:, :-1], tokens[:, 1:], mask, torch.arange(SEQ).expand(BATCH, SEQ)


def _written_out(model: GPTModel, tokens, labels, mask, positions):
    """(total loss, [token-mean loss of depth k]) from the definition (module docstring)."""
    rotary = model.rotary_pos_emb(SEQ)
    hidden = model.decoder(model.embedding(tokens, positions), None, rotary_pos_emb=rotary)
    weight = model.embedding.word_embeddings.weight

    def token_mean(hidden, labels, mask):
        logits = hidden.transpose(0, 1) @ weight.t()  # [b, s, V]
        losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        return (losses * mask.reshape(-1)).sum() / mask.sum()

    total = token_mean(hidden, labels, mask)
    depth_losses = []
    for layer in model.mtp.layers:
        tokens, positions, labels, mask = (roll_tensor(t) for t in (tokens, positions, labels, mask))
        combined = torch.cat([layer.enorm(model.embedding(tokens, positions)), layer.hnorm(hidden)], dim=-1)
        hidden = layer.final_layernorm(layer.mtp_model_layer(layer.eh_proj(combined)[0], None,
                                                             rotary_pos_emb=rotary)[0])
        depth_losses.append(token_mean(hidden, labels, mask))
    return total + FACTOR / DEPTHS * sum(depth_losses), depth_losses


def test_loss_and_gradients_match_the_definition():
    tokens, labels, mask, positions = _batch()
    model = _model()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    mtp_losses_for_logging(DEPTHS, 1.0)  # clears what earlier training forwards of MTP models left
    losses = model(tokens, positions, None, labels=labels, loss_mask=mask)
    ((losses * mask).sum() / mask.sum()).backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    logged = mtp_losses_for_logging(DEPTHS, 1.0)

    model.zero_grad()
    total, depth_losses = _written_out(model, tokens, labels, mask, positions)
    total.backward()
    for depth, expected in enumerate(depth_losses, start=1):
        assert abs(logged[f"mtp_{depth} loss"].item() - expected.item()) < 1e-6
    assert any(name.startswith("mtp.layers.1.eh_proj") for name in grads)
    for name, param in model.named_parameters():
        scale = param.grad.abs().max().clamp_min(1.0)
        assert ((grads[name] - param.grad).abs().max() / scale).item() < 1e-6, name


def test_depths_run_only_with_labels_and_context_parallelism_is_refused():
    tokens, labels, mask, positions = _batch()
    model = _model().eval()
    calls = []
    model.mtp.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        logits = model(tokens, positions, None)
    assert logits.shape == (BATCH, SEQ, VOCAB) and not calls
    with pytest.raises(ValueError, match="mtp_num_layers with context_parallel_size=2 is not supported yet"):
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, mtp_num_layers=1,
                          context_parallel_size=2)
