"""The training layer: arguments, `pretrain()`, checkpoints, tokenizers, logging.

Kept import-light on purpose: `tools/preprocess_data.py` imports `megatron.training.tokenizer`, which must
work without torch (user-pain-points A2).
"""
