"""Tiny Hugging Face models and GPTModels with the same weights (through the explicit weight maps of the
model tests), for the generation tests: a GPT-2 (learned positions, MHA, LayerNorm, biases, tied
embeddings) and a Llama (RoPE, GQA, SwiGLU, RMSNorm, untied, no biases)."""

import torch
import torch.nn.functional as F
import transformers

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt.hf_weight_maps import gpt2_to_megatron, llama_to_megatron

VOCAB, HIDDEN, LAYERS, HEADS, GROUPS, FFN, MAX_POSITIONS = 96, 64, 2, 4, 2, 128, 64
# Larger than the usual 0.02, so that the logits are far apart and greedy choices are not near-ties.
INIT_STD = 0.2
# Built on the CPU even where there is a GPU (the GPU tests move them).
COMMON = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
              attention_dropout=0.0, layernorm_epsilon=1e-5, use_cpu_initialization=True)


def gpt2_pair(attention_backend: str = "auto"):
    """(GPT2LMHeadModel, GPTModel) in eval mode with the same weights."""
    torch.manual_seed(11)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=INIT_STD,
    )).eval()
    config = TransformerConfig(**COMMON, ffn_hidden_size=FFN, attention_backend=attention_backend)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=MAX_POSITIONS,
                     share_embeddings_and_output_weights=True).eval()
    model.load_state_dict(gpt2_to_megatron(hf.state_dict(), LAYERS, HEADS), strict=True)
    return hf, model


def llama_pair(attention_backend: str = "auto"):
    """(LlamaForCausalLM, GPTModel) in eval mode with the same weights."""
    torch.manual_seed(12)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        attn_implementation="eager", initializer_range=INIT_STD,
    )).eval()
    config = TransformerConfig(
        **COMMON, num_query_groups=GROUPS, ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, attention_backend=attention_backend,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=MAX_POSITIONS,
                     position_embedding_type="rope").eval()
    model.load_state_dict(llama_to_megatron(hf.state_dict(), LAYERS, HEADS, GROUPS), strict=True)
    return hf, model


PAIRS = {"gpt2": gpt2_pair, "llama": llama_pair}


def full_forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, V] logits of one plain forward pass over `tokens` [b, s] (no cache)."""
    positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


def random_tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
