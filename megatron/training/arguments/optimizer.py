"""Optimizer, regularisation and learning-rate schedule flags.

The schedule counts samples, not iterations: iteration-valued flags are multiplied by the global batch
size when the scheduler is built (as Megatron-LM's `OptimizerParamScheduler`, which steps in samples).
"""

import argparse


def _add_optimizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="optimizer")
    group.add_argument("--optimizer", default="adam",
                       choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"],
                       help="adam is AdamW (decoupled weight decay); sgd uses --sgd-momentum.")
    group.add_argument("--use-precision-aware-optimizer", action="store_true",
                       help="Let the optimizer keep state in lower precision (Adam and --use-distributed-optimizer "
                            "only); what is built: --exp-avg-dtype / --exp-avg-sq-dtype bf16.")
    group.add_argument("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"],
                       help="dtype of the main gradients with --use-precision-aware-optimizer (fp32 only so far).")
    group.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"],
                       help="dtype of the main params with --use-precision-aware-optimizer (fp32 only so far).")
    group.add_argument("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                       help="dtype Adam's first moment is stored in with --use-precision-aware-optimizer (fp32 or "
                            "bf16 so far); the update itself computes in fp32.")
    group.add_argument("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                       help="dtype Adam's second moment is stored in with --use-precision-aware-optimizer (fp32 or "
                            "bf16 so far); the update itself computes in fp32.")
    return parser


def _add_regularization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="regularization")
    group.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states.")
    group.add_argument("--weight-decay", type=float, default=0.01,
                       help="Weight decay (biases and 1-D parameters get none).")
    group.add_argument("--start-weight-decay", type=float, default=None,
                       help="Initial weight decay with a non-constant --weight-decay-incr-style.")
    group.add_argument("--end-weight-decay", type=float, default=None,
                       help="Final weight decay with a non-constant --weight-decay-incr-style.")
    group.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"],
                       help="How weight decay moves from --start-weight-decay to --end-weight-decay.")
    group.add_argument("--clip-grad", type=float, default=1.0, help="Clip gradients to this global L2 norm.")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    return parser


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--lr-decay-style", default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                       help="Learning-rate decay after warmup.")
    group.add_argument("--lr-wsd-decay-style", default="exponential",
                       choices=["exponential", "linear", "cosine", "minus_sqrt"],
                       help="Anneal shape of the WSD schedule.")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iterations to decay over (default --train-iters).")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="Samples to decay over (default --train-samples).")
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="Length of the WSD anneal, iterations.")
    group.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="Length of the WSD anneal, samples.")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Warmup as a fraction of the decay steps; exclusive with --lr-warmup-iters/-samples.")
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup length, iterations.")
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Linear warmup length, samples.")
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Floor of the decayed learning rate.")
    group.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                       dest="override_opt_param_scheduler",
                       help="Take the schedule from these flags and ignore the one in the checkpoint.")
    group.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                       action="store_true", dest="use_checkpoint_opt_param_scheduler",
                       help="Take the schedule from the checkpoint and ignore these flags.")
    group.add_argument("--decoupled-lr", type=float, default=None,
                       help="Separate learning rate for the embedding and output layer.")
    group.add_argument("--decoupled-min-lr", type=float, default=None,
                       help="Minimum learning rate for the embedding and output layer.")
    return parser
