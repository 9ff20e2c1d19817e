"""Check a training command line for a world size and print parameters, memory per GPU and FLOPs.

    WORLD_SIZE=64 python tools/estimate.py --num-layers 24 --hidden-size 2048 ... (pretrain_gpt.py's flags)

The same as `pretrain_gpt.py ... --dry-run`: no GPU, NCCL or data is touched.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.dry_run import dry_run  # noqa: E402

if __name__ == "__main__":
    args = validate_args(parse_args(), {"tokenizer_type": "GPT2BPETokenizer"})
    dry_run(args)
