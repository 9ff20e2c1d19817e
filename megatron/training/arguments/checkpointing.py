"""Checkpoint save/load flags."""

import argparse

from megatron.core.dist_checkpointing.strictness import STRICT_HANDLING


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                       dest="save_interval", help="Iterations between checkpoint saves (required with --save).")
    group.add_argument("--save-retain-interval", type=int, default=None,
                       help="Keep only checkpoints on this interval (plus the latest); a multiple of "
                            "--save-interval.")
    # Megatron gives these store_true flags a None default; code tests them for truth.
    group.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer.")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state.")
    group.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    group.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load the optimizer.")
    group.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load the RNG state.")
    group.add_argument("--finetune", action="store_true",
                       help="Load only the model: iteration 0, no optimizer or RNG state, counters reset.")
    group.add_argument("--pretrained-checkpoint", type=str, default=None,
                       help="Checkpoint to start from when --load has none.")
    group.add_argument("--ckpt-step", type=int, default=None, help="Load this iteration instead of the latest.")
    group.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                       help="Skip weight initialisation (when a checkpoint will be loaded anyway).")
    group.add_argument("--use-checkpoint-args", action="store_true",
                       help="Take the model-shape arguments from the checkpoint.")
    group.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                       help="Take the model-parallel sizes from the checkpoint.")
    group.add_argument("--no-use-tokenizer-model-from-checkpoint-args", action="store_false",
                       dest="use_tokenizer_model_from_checkpoint_args",
                       help="With --use-checkpoint-args, keep this command line's tokenizer model.")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="Exit instead of initialising randomly when --load has no checkpoint.")
    group.add_argument("--ckpt-format", default="torch_dist",
                       choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
                       help="Checkpoint format: torch_dist (sharded, loads under any TP/PP/DP layout; the default, as "
                            "in Megatron-LM) or torch (one file per model-parallel rank).")
    group.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                       help="torch_dist with --use-distributed-optimizer: write the optimizer state per parameter "
                            "(loads under any TP/PP/DP layout and into either optimizer) instead of per DDP bucket "
                            "(loads only under the saving TP/PP layout).")
    group.add_argument("--auto-detect-ckpt-format", action="store_true",
                       help="Detect the format of the checkpoint being loaded.")
    group.add_argument("--ckpt-convert-format", default=None, choices=["torch", "torch_dist"],
                       help="Save the loaded checkpoint again in this format, under <--ckpt-convert-save>/<format>.")
    group.add_argument("--ckpt-convert-save", default=None, help="Where to save the converted checkpoint.")
    group.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save",
                       help="Do not spread distributed-checkpoint writes over data-parallel ranks.")
    group.add_argument("--ckpt-fully-parallel-load", action="store_true",
                       help="Spread distributed-checkpoint reads over data-parallel ranks.")
    group.add_argument("--async-save", action="store_true", default=None,
                       help="Write torch_dist checkpoints in the background.")
    group.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected", choices=STRICT_HANDLING,
                       help="Key-mismatch policy when loading a torch_dist checkpoint (Megatron-Core's StrictHandling).")
    group.add_argument("--non-persistent-save-interval", type=int, default=None,
                       help="Iterations between non-persistent (rolling) saves.")
    group.add_argument("--non-persistent-ckpt-type", default=None, choices=["global", "local", "in_memory"],
                       help="Kind of non-persistent checkpoint.")
    group.add_argument("--non-persistent-global-ckpt-dir", type=str, default=None,
                       help="Directory of global non-persistent checkpoints.")
    return parser
