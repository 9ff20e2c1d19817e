"""Adapters between Megatron-Core model state dicts and other formats (Hugging Face `transformers`)."""
