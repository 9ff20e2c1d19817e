"""Hugging Face GPT-2 / Llama state dicts -> GPTModel keys for the model tests, through the checkpoint
converter's adapters (megatron/training/checkpointing/conversion/gpt2_hf.py, llama_hf.py): one weight map,
proven here by logits parity with `transformers`."""

import torch

from megatron.training.checkpointing.conversion import gpt2_hf, llama_hf
from megatron.training.checkpointing.conversion.gpt_shape import GPTShape


def _shape(num_layers: int, num_heads: int, num_groups: int, head_dim: int, llama: bool) -> GPTShape:
    """The fields the weight maps read; the others do not change the map."""
    return GPTShape(
        num_layers=num_layers, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        num_query_groups=num_groups, kv_channels=head_dim, ffn_hidden_size=0, swiglu=llama,
        add_bias_linear=not llama, add_qkv_bias=False, normalization="RMSNorm" if llama else "LayerNorm",
        norm_epsilon=1e-5, position_embedding_type="rope" if llama else "learned_absolute",
        max_position_embeddings=0, rotary_base=10000.0, use_rope_scaling=False, rope_scaling_factor=8.0,
        tied_embeddings=not llama, gelu="gelu", vocab_size=None, padded_vocab_size=0, params_dtype=torch.float32,
    )


def gpt2_to_megatron(hf_state: dict, num_layers: int, num_heads: int) -> dict:
    """GPT2LMHeadModel state dict -> GPTModel (tied embeddings, learned positions, biases)."""
    head_dim = hf_state["transformer.wte.weight"].shape[1] // num_heads
    return gpt2_hf.gpt2_to_megatron(hf_state, _shape(num_layers, num_heads, num_heads, head_dim, llama=False))


def llama_to_megatron(hf_state: dict, num_layers: int, num_heads: int, num_groups: int) -> dict:
    """LlamaForCausalLM state dict -> GPTModel (RMSNorm, SwiGLU fc1 = cat([gate, up]), untied, no bias)."""
    head_dim = hf_state["model.layers.0.self_attn.q_proj.weight"].shape[0] // num_heads
    return llama_hf.llama_to_megatron(hf_state, _shape(num_layers, num_heads, num_groups, head_dim, llama=True))
