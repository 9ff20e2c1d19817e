"""Batch size, run length, activation recomputation, exit conditions and evaluation flags."""

import argparse

# Signal names accepted by --exit-signal; validation turns the name into a `signal.Signals`.
EXIT_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def _add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None,
                       help="Sequences per model replica per forward pass.")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Sequences per optimizer step = micro-batch-size x microbatches x data-parallel "
                            "size (default micro-batch-size x data-parallel size: one microbatch).")
    group.add_argument("--rampup-batch-size", nargs="*", type=int, default=None,
                       help="<start> <increment> <samples>: grow the global batch from <start> by <increment> "
                            "over <samples> samples, e.g. 16 16 5859375.")
    group.add_argument("--step-batch-size-schedule", type=str, default=None,
                       help='Step-wise global batch schedule, e.g. "0:16 2.4B:320".')
    group.add_argument("--decrease-batch-size-if-needed", action="store_true",
                       help="Shrink the global batch when micro-batch x data-parallel size does not divide it.")
    group.add_argument("--train-iters", type=int, default=None,
                       help="Iterations to train over all runs; exclusive with --train-samples.")
    group.add_argument("--train-samples", type=int, default=None,
                       help="Samples to train over all runs; exclusive with --train-iters.")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Shorthand for --recompute-granularity selective.")
    group.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                       help="full: recompute whole layers (needs --recompute-method and --recompute-num-layers); "
                            "selective: recompute --recompute-modules only.")
    group.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                       help="uniform: checkpoint chunks of --recompute-num-layers layers; block: recompute the "
                            "first --recompute-num-layers layers of each pipeline stage.")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="Layers per recompute chunk (uniform) or per pipeline stage (block).")
    group.add_argument("--recompute-modules", nargs="*", default=None,
                       help='Submodules recomputed with selective granularity (default ["core_attn"]).')
    group.add_argument("--distribute-saved-activations", action="store_true",
                       help="Shard recomputation checkpoints across the tensor-parallel group.")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad",
                       help="Do not stop on NaN loss or gradients (off automatically with fp16 dynamic scaling).")
    group.add_argument("--calculate-per-token-loss", action="store_true",
                       help="Normalise the loss by the global token count instead of per microbatch.")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Save and exit when the iteration is a multiple of this value.")
    group.add_argument("--exit-duration-in-mins", type=int, default=None,
                       help="Save and exit after this many minutes.")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="Save and exit when --exit-signal is received.")
    group.add_argument("--exit-signal", default="SIGTERM", choices=EXIT_SIGNAL_NAMES,
                       help="Signal caught by --exit-signal-handler.")
    group.add_argument("--manual-gc", action="store_true",
                       help="Disable Python's automatic garbage collection and collect on a schedule.")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="Iterations between manual collections (0: none in training; evaluation still "
                            "collects unless --no-manual-gc-eval).")
    group.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="With --manual-gc, do not collect around evaluation.")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Call torch.cuda.empty_cache(): 0 never, 1 after the forward-backward pass, 2 also "
                            "after the optimizer step.")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None,
                       help="Initialise full weights on the CPU then split them (same init for every TP size).")
    return parser


def _add_validation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Iterations per evaluation.")
    # Megatron <= v0.15 defaulted to 1000; v0.16 and main to None: no evaluation during training, only the
    # one after it (the validation split then holds one evaluation's samples, data_iterators.py).
    group.add_argument("--eval-interval", type=int, default=None,
                       help="Iterations between evaluations on the validation set (default: none during training, "
                            "one evaluation after it).")
    group.add_argument("--skip-train", action="store_true", help="Skip training; only evaluate.")
    group.add_argument("--full-validation", action="store_true", help="Evaluate on the whole validation set.")
    group.add_argument("--multiple-validation-sets", action="store_true",
                       help="Evaluate each validation dataset separately.")
    return parser


def _add_autoresume_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="autoresume")
    group.add_argument("--adlr-autoresume", action="store_true",
                       help="Enable autoresume on NVIDIA's ADLR cluster.")
    group.add_argument("--adlr-autoresume-interval", type=int, default=1000,
                       help="Iterations between autoresume checks.")
    return parser
