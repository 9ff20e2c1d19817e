"""Console, TensorBoard, Weights & Biases, timer and profiler flags."""

import argparse


def _add_logging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    group.add_argument("--tensorboard-dir", type=str, default=None, help="Write TensorBoard events here.")
    group.add_argument("--tensorboard-log-interval", type=int, default=1,
                       help="Iterations between TensorBoard writes.")
    group.add_argument("--tensorboard-queue-size", type=int, default=1000,
                       help="Pending TensorBoard events before a flush.")
    group.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write timers to TensorBoard.")
    group.add_argument("--no-log-learning-rate-to-tensorboard", action="store_false",
                       dest="log_learning_rate_to_tensorboard", help="Do not write the learning rate to TensorBoard.")
    group.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                       dest="log_loss_scale_to_tensorboard", help="Do not write the loss scale to TensorBoard.")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                       help="Write validation perplexity to TensorBoard.")
    group.add_argument("--log-memory-to-tensorboard", action="store_true",
                       help="Write CUDA memory statistics to TensorBoard.")
    group.add_argument("--log-world-size-to-tensorboard", action="store_true",
                       help="Write the world size to TensorBoard.")
    group.add_argument("--log-params-norm", action="store_true", help="Log the L2 norm of the parameters.")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log the number of zero gradients.")
    group.add_argument("--log-throughput", action="store_true", help="Log TFLOP/s per GPU.")
    group.add_argument("--log-progress", action="store_true",
                       help="Append tokens and FLOPs so far to progress.txt in the save directory.")
    group.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                       help="0: iteration time only; 1: also once-per-iteration timers; 2: all timers.")
    group.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                       help="Report the max, the min and max, or every rank's time.")
    group.add_argument("--no-barrier-with-level-1-timing", action="store_false", dest="barrier_with_L1_time",
                       help="Do not put a barrier before level-1 timers.")
    group.add_argument("--wandb-project", type=str, default=None, help="Weights & Biases project (off if unset).")
    group.add_argument("--wandb-exp-name", type=str, default=None, help="Weights & Biases run name.")
    group.add_argument("--wandb-save-dir", type=str, default=None, help="Local Weights & Biases directory.")
    group.add_argument("--wandb-entity", type=str, default=None, help="Weights & Biases entity.")
    group.add_argument("--logging-level", type=int, default=None, help="Level of the Python logging module.")
    group.add_argument("--profile", action="store_true",
                       help="Profile iterations --profile-step-start to --profile-step-end - 1: with nsys through "
                            "cudaProfilerStart/Stop (nsys profile --capture-range=cudaProfilerApi), or with "
                            "torch.profiler given --use-pytorch-profiler.")
    group.add_argument("--profile-step-start", type=int, default=10, help="First profiled iteration.")
    group.add_argument("--profile-step-end", type=int, default=12, help="Iteration where profiling stops.")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="With --profile: torch.profiler, a Chrome trace per rank in "
                            "<tensorboard-dir>/../torch_profile/ and a kernel-time summary on the console.")
    group.add_argument("--profile-ranks", nargs="*", type=int, default=[],
                       help="Global ranks to profile (and to record memory history on); none given: all ranks.")
    group.add_argument("--record-memory-history", action="store_true",
                       help="Record the CUDA allocator's history from start-up and dump it at every logged "
                            "iteration (and on out-of-memory) to --memory-snapshot-path, per rank.")
    group.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle",
                       help="Where --record-memory-history writes its snapshot (<base>_<rank><ext>).")
    return parser
