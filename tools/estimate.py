"""Check a training command line for a world size and print parameters, memory per GPU and FLOPs.

    WORLD_SIZE=64 python tools/estimate.py --num-layers 24 --hidden-size 2048 ... (pretrain_gpt.py's flags)

The same as `pretrain_gpt.py ... --dry-run`: no GPU, NCCL or data is touched.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a clone without pip install

from megatron.training.dry_run import dry_run  # noqa: E402
from megatron.training.errors import run_entry_point  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.preflight import preflight  # noqa: E402


def main() -> None:
    # As pretrain() starts: parsed, validated and set as the run's arguments, before torch.distributed.
    args = initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, skip_mpu_initialization=True)
    args.dry_run = True
    preflight(args)
    dry_run(args)


if __name__ == "__main__":
    run_entry_point(main)
