"""Generate text from a Megatron checkpoint (TP=1, PP=1), on the CPU or a GPU.

    python tools/text_generation_cli.py --load checkpoints/gpt --prompt "Hello" --max-new-tokens 32 --greedy
    python tools/text_generation_cli.py --load checkpoints/gpt --top-p 0.9      # prompts from stdin

The logic lives in megatron/training/generation/cli.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.generation.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
