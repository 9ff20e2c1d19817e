"""Mixed-precision flags, including the FP8/FP4 flags of Megatron's "Transformer-Engine" group."""

import argparse


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="Train in float16 with loss scaling.")
    group.add_argument("--bf16", action="store_true", help="Train in bfloat16.")
    group.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="With --bf16, accumulate and reduce gradients in bf16 instead of fp32.")
    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static fp16 loss scale (default: dynamic scaling).")
    group.add_argument("--initial-loss-scale", type=float, default=2**32, help="Initial dynamic loss scale.")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    group.add_argument("--loss-scale-window", type=float, default=1000,
                       help="Clean steps before the dynamic loss scale is doubled.")
    group.add_argument("--hysteresis", type=int, default=2,
                       help="Overflows tolerated before the dynamic loss scale is halved.")
    group.add_argument("--fp32-residual-connection", action="store_true",
                       help="Keep the residual stream in fp32 (with --fp16 or --bf16).")
    group.add_argument("--apply-query-key-layer-scaling", action="store_true",
                       help="Scale Q.K^T by 1 / layer number (fp16 stability); implies "
                            "--attention-softmax-in-fp32.")
    group.add_argument("--attention-softmax-in-fp32", action="store_true",
                       help="Run attention masking and softmax in fp32.")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Accumulate and all-reduce gradients in fp32 (always on with --bf16 unless "
                            "--grad-reduce-in-bf16).")
    group.add_argument("--fp16-lm-cross-entropy", action="store_true",
                       help="Compute the unreduced LM cross-entropy in fp16 (with --fp16).")
    return parser


def _add_low_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="fp8 / fp4")
    group.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8",
                       help="FP8 format for GEMMs: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 backward).")
    group.add_argument("--fp8-recipe", default="delayed",
                       choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"], help="FP8 scaling recipe.")
    group.add_argument("--fp8-margin", type=int, default=0, help="FP8 scaling margin.")
    group.add_argument("--fp8-interval", type=int, default=1, help="Deprecated in Megatron; ignored there too.")
    group.add_argument("--fp8-amax-history-len", type=int, default=1, help="Length of the amax history.")
    group.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                       help="How the scale is computed from the amax history.")
    group.add_argument("--no-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                       help="Compute weight gradients in higher precision in FP8 runs.")
    group.add_argument("--fp8-param-gather", action="store_true",
                       help="Keep parameters in FP8 and all-gather them in FP8.")
    group.add_argument("--first-last-layers-bf16", action="store_true",
                       help="Keep the first and last layers in bf16 during FP8 training.")
    group.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                       help="Leading layers kept in bf16 with --first-last-layers-bf16.")
    group.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                       help="Trailing layers kept in bf16 with --first-last-layers-bf16.")
    group.add_argument("--fp4-format", default=None, choices=["e2m1"], dest="fp4", help="FP4 format for GEMMs.")
    group.add_argument("--fp4-recipe", default="nvfp4", choices=["nvfp4", "custom"], help="FP4 scaling recipe.")
    group.add_argument("--fp4-param-gather", action="store_true", dest="fp4_param",
                       help="Keep parameters in FP4 and all-gather them in FP4.")
    group.add_argument("--te-rng-tracker", action="store_true",
                       help="Use Transformer Engine's random-number tracker.")
    return parser
