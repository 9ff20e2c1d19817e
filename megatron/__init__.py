"""A Megatron-LM-compatible pretraining framework on plain PyTorch.

`megatron.core` is the library (no argparse, configured by dataclasses; `megatron.core.tokenizers` needs no
torch); `megatron.training` holds the argparse front end and the `pretrain()` loop; `megatron.preprocessing`
is the engine of the data tools, which import neither torch nor model code.
"""

__version__ = "0.1.0"
