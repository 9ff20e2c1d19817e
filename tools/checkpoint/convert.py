"""Megatron's checkpoint converter: reshard torch-format GPT checkpoints to any TP/PP/EP, export to and
import from Hugging Face (GPT-2, Llama / Mistral / Qwen2, Mixtral).

    python tools/checkpoint/convert.py --model-type GPT --loader core --saver core \\
        --load-dir ckpt --save-dir ckpt-tp2 --target-tensor-parallel-size 2
    python tools/checkpoint/convert.py --model-type GPT --loader core --saver hf --load-dir ckpt --save-dir hf-model

The logic lives in megatron/training/checkpointing/conversion/ (convert.py and the loader_*/saver_* plugins).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from a clone without pip install

from megatron.training.checkpointing.conversion.convert import main  # noqa: E402
from megatron.training.errors import run_entry_point  # noqa: E402

if __name__ == "__main__":
    run_entry_point(main)
