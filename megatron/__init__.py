"""A Megatron-LM-compatible pretraining framework on plain PyTorch.

`megatron.core` is the library (no argparse, configured by dataclasses); `megatron.training` holds the
argparse front end, the `pretrain()` loop and the tokenizers. The data tools import neither torch nor
model code.
"""

__version__ = "0.1.0"
