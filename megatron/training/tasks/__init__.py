"""The model-specific pieces each entry script hands to `pretrain()`: providers, batches, losses."""
