"""Text generation from a training checkpoint: rebuilding the model, and the command line of
`tools/text_generation_cli.py`. The generation itself is `megatron.core.inference`."""

from megatron.training.generation.checkpoint_model import load_model_for_inference

__all__ = ["load_model_for_inference"]
