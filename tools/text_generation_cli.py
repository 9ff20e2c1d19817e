"""Generate text from a Megatron checkpoint (TP=1, PP=1), on the CPU or a GPU.

    python tools/text_generation_cli.py --load checkpoints/gpt --prompt "Hello" --max-new-tokens 32 --greedy
    python tools/text_generation_cli.py --load checkpoints/gpt --top-p 0.9      # prompts from stdin

The logic lives in megatron/training/generation/cli.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a clone without pip install

from megatron.training.generation.cli import main  # noqa: E402
from megatron.training.errors import run_entry_point  # noqa: E402

if __name__ == "__main__":
    run_entry_point(main)
