"""Show what a torch-format checkpoint holds, on the CPU: iteration, arguments, parallel layout, tensors
per rank (name, shape, dtype), optimizer / scheduler / RNG presence.

    python tools/checkpoint/inspect_checkpoint.py --load-dir checkpoints/gpt

Not named `inspect.py`: a script's own folder comes first on sys.path, so that name would hide the
standard library's `inspect` from everything the script imports. The logic lives in
megatron/training/checkpointing/conversion/inspect_checkpoint.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.training.checkpointing.conversion.inspect_checkpoint import main  # noqa: E402
from megatron.training.errors import run_entry_point  # noqa: E402

if __name__ == "__main__":
    run_entry_point(main)
