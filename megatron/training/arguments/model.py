"""Model shape, initialisation and kernel-fusion flags (Megatron's "network size", "initialization" and
the fusion switches of its "training" group)."""

import argparse


def _add_network_size_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--encoder-num-layers", type=int, default=None,
                       help="Number of encoder layers (T5); exclusive with --num-layers.")
    group.add_argument("--decoder-num-layers", type=int, default=None, help="Number of decoder layers (T5).")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="MLP hidden size. Default 4 * hidden-size, or int(8 * hidden-size / 3 / 64) * 64 "
                            "with --swiglu.")
    group.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    group.add_argument("--attention-backend", default="auto", choices=["flash", "fused", "unfused", "local", "auto"],
                       help="Attention kernel: flash, fused (cuDNN/efficient), unfused (plain PyTorch), local, "
                            "or auto (fastest available).")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Per-head projection size. Default hidden-size / num-attention-heads.")
    group.add_argument("--group-query-attention", action="store_true",
                       help="Use grouped-query attention. --num-query-groups is ignored without this flag.")
    group.add_argument("--num-query-groups", type=int, default=1,
                       help="Number of key/value heads with --group-query-attention.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Size of the position-embedding table; must be >= --seq-length.")
    group.add_argument("--position-embedding-type", default="learned_absolute",
                       choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
                       help="Position embedding type.")
    group.add_argument("--rotary-base", type=int, default=10000, help="Base of the rotary embedding frequencies.")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's channels that is rotated (partial rotary).")
    group.add_argument("--rotary-interleaved", action="store_true",
                       help="Rotate interleaved channel pairs instead of the two halves (rotate-half, HF Llama).")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Divide rotary positions by this factor (linear position interpolation).")
    group.add_argument("--use-rope-scaling", action="store_true", help="Apply Llama-3.1 style RoPE scaling.")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Llama-3.1 RoPE scaling factor.")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this value times the tensor-parallel size.")
    group.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                       help="Normalisation layer.")
    group.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of LayerNorm / RMSNorm.")
    group.add_argument("--apply-layernorm-1p", action="store_true",
                       help="Zero-centred LayerNorm gamma: the stored weight is gamma - 1.")
    group.add_argument("--qk-layernorm", action="store_true", help="Normalise queries and keys per head.")
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                       help="Take the residual after the layer norm (original BERT ordering).")
    group.add_argument("--openai-gelu", action="store_true", help="Use the tanh approximation of GeLU.")
    group.add_argument("--squared-relu", action="store_true", help="Use squared ReLU instead of GeLU.")
    group.add_argument("--swiglu", action="store_true", help="Use a SiLU gated linear unit (fc1 is doubled).")
    group.add_argument("--quick-geglu", action="store_true", help="Use a quick-GeLU gated linear unit.")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="Remove the bias of every linear layer.")
    group.add_argument("--add-qkv-bias", action="store_true", help="Keep a bias on the QKV projection only.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Give the output layer its own weight instead of the input embedding.")
    group.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                       help="Disable the BERT next-sentence (binary) head.")
    group.add_argument("--transformer-impl", default="local",
                       choices=["local", "transformer_engine", "inference_optimized"],
                       help="Layer implementation. Megatron's default is transformer_engine; here the default "
                            "is local (pure PyTorch), which needs no extra package.")
    group.add_argument("--spec", nargs="*", default=None,
                       help="<module> <function> returning a custom layer spec, or 'local'.")
    return parser


def _add_initialization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234, help="Seed for python, numpy and torch.")
    group.add_argument("--data-parallel-random-init", action="store_true",
                       help="Initialise parameters differently on each data-parallel rank.")
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Std of the normal init; output projections use std / sqrt(2 * num-layers).")
    group.add_argument("--embedding-init-method-std", type=float, default=None,
                       help="Std of the embedding init (default: --init-method-std).")
    group.add_argument("--init-method-xavier-uniform", action="store_true", help="Use Xavier-uniform init.")
    return parser


def _add_fusion_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="kernel fusion")
    group.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                       help="Disable the fused scale + mask + softmax kernel.")
    group.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                       help="Disable the fused bias + GeLU kernel.")
    group.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                       help="Disable the fused bias + SwiGLU kernel.")
    group.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                       help="Disable the fused bias + dropout + add kernel.")
    group.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                       help="Disable the fused rotary-embedding kernel.")
    group.add_argument("--no-persist-layer-norm", action="store_true",
                       help="Disable the persistent fused layer-norm kernel.")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="Use the fused cross-entropy kernel.")
    group.add_argument("--use-torch-compile", action="store_true",
                       help="Compile each transformer layer's training step with torch.compile on CUDA.")
    group.add_argument("--cuda-graph-impl", default="none", choices=["none", "local", "transformer_engine",
                                                                      "full_iteration"],
                       help="full_iteration: replay each training iteration's forward and backward passes from "
                            "one CUDA graph (one GPU; see the README's performance section). local and "
                            "transformer_engine (per-layer graphs) are not built yet.")
    group.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                       help="Eager iterations before the CUDA graph is captured.")
    group.add_argument("--cuda-graph-modules", nargs="*", default=[],
                       help="Parts of each layer captured by per-layer CUDA graphs (not built yet; must be empty "
                            "with --cuda-graph-impl full_iteration).")
    return parser
