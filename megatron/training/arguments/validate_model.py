"""Model shape: required sizes, Megatron's derived defaults, divisibility by the parallel sizes, recompute.

    ffn_hidden_size = 4h, or int(4h * 2/3 / 64) * 64 with SwiGLU (two fc1 halves, about the same params)
    kv_channels     = h / heads
    seq_length      = encoder_seq_length when only that is given
"""

import argparse

from megatron.core.model_parallel_config import divisors
from megatron.core.transformer.transformer_config import tensor_parallel_sizes_for_attention
from megatron.training.arguments.reporting import warn_rank_0
from megatron.training.arguments.validate_parallel import legal_sizes


def _derive_num_layers(args, problems) -> None:
    if None not in (args.num_layers, args.encoder_num_layers) and args.num_layers != args.encoder_num_layers:
        problems.append(f"give --num-layers or --encoder-num-layers, not both (got {args.num_layers} and "
                        f"{args.encoder_num_layers})")
    elif args.num_layers is not None:
        args.encoder_num_layers = args.num_layers
    else:
        args.num_layers = args.encoder_num_layers


def _check_required_sizes(args, problems) -> bool:
    """True when every required size is present and positive."""
    ok = True
    for flag, dest in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"),
                       ("--max-position-embeddings", "max_position_embeddings")):
        value = getattr(args, dest)
        if value is None:
            problems.append(f"{flag} is required")
            ok = False
        elif value < 1:
            problems.append(f"{flag} {value} must be positive")
            ok = False
    return ok


def _derive_widths(args, problems) -> None:
    h, heads = args.hidden_size, args.num_attention_heads
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64
            if args.ffn_hidden_size == 0:
                problems.append(f"--swiglu's default --ffn-hidden-size int(8 x {h} / 3 / 64) x 64 is 0 for "
                                f"--hidden-size {h}; pass --ffn-hidden-size")
        else:
            args.ffn_hidden_size = 4 * h
    if args.kv_channels is None:
        if h % heads:
            problems.append(f"--hidden-size {h} is not divisible by --num-attention-heads {heads} "
                            f"({h / heads:.2f} per head); pass --kv-channels or use a head count in "
                            f"{legal_sizes(h)}")
        else:
            args.kv_channels = h // heads


def _check_tensor_parallel_split(args, problems) -> None:
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if tp < 1:
        return
    if heads % tp:
        problems.append(f"--num-attention-heads {heads} must be divisible by --tensor-model-parallel-size {tp}; "
                        f"valid TP sizes: {legal_sizes(heads)}")
    if not args.group_query_attention and args.num_query_groups != 1:
        warn_rank_0(f"--num-query-groups {args.num_query_groups} is ignored without --group-query-attention "
                    f"(Megatron's rule): every head gets its own key/value head")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups < 1 or heads % groups:
            problems.append(f"--num-query-groups {groups} must divide --num-attention-heads {heads}; valid: "
                            f"{legal_sizes(heads)}")
        elif groups % tp and tp % groups:
            # tp > groups works too: tp/groups ranks share each key/value head (Megatron-Core does the same).
            legal = ", ".join(map(str, tensor_parallel_sizes_for_attention(heads, groups)))
            problems.append(f"--num-query-groups {groups} must be a multiple or a divisor of "
                            f"--tensor-model-parallel-size {tp}; valid TP sizes: {legal}")
    if args.ffn_hidden_size and args.ffn_hidden_size % tp:
        legal = ", ".join(str(size) for size in divisors(heads) if args.ffn_hidden_size % size == 0)
        problems.append(f"--ffn-hidden-size {args.ffn_hidden_size} must be divisible by "
                        f"--tensor-model-parallel-size {tp}; valid TP sizes (dividing it and the heads): {legal}")


def _derive_sequence_lengths(args, problems) -> None:
    if None not in (args.seq_length, args.encoder_seq_length) and args.seq_length != args.encoder_seq_length:
        problems.append(f"give --seq-length or --encoder-seq-length, not both (got {args.seq_length} and "
                        f"{args.encoder_seq_length})")
        return
    if args.seq_length is None:
        args.seq_length = args.encoder_seq_length
    else:
        args.encoder_seq_length = args.seq_length
    if args.seq_length is None:
        problems.append("--seq-length is required")
        return
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1 and args.seq_length % (2 * cp):
        problems.append(f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size {cp} "
                        f"= {2 * cp} (each CP rank holds two chunks)")
    # With both, each CP rank's two chunks are split again over the TP ranks.
    sequence_multiple = tp * 2 * cp if cp > 1 else tp
    if args.sequence_parallel and tp >= 1 and args.seq_length % sequence_multiple:
        shown = f"--tensor-model-parallel-size {tp}" + (
            f" x 2 x --context-parallel-size {cp} = {sequence_multiple}" if cp > 1 else "")
        problems.append(f"--seq-length {args.seq_length} must be divisible by {shown} with --sequence-parallel")
    max_positions = args.max_position_embeddings
    if max_positions is not None:
        for flag, length in (("--seq-length", args.seq_length), ("--decoder-seq-length", args.decoder_seq_length)):
            if length is not None and max_positions < length:
                problems.append(f"--max-position-embeddings {max_positions} must be >= {flag} {length}")


def _sync_feature_flags(args, problems) -> None:
    """Megatron's couplings between flags."""
    activations = [flag for flag, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                         ("--quick-geglu", args.quick_geglu)) if on]
    if len(activations) > 1:
        problems.append(f"choose one activation: {' and '.join(activations)} were both given")
    if not 0.0 < args.rotary_percent <= 1.0:
        problems.append(f"--rotary-percent {args.rotary_percent} must be in (0, 1]")
    if args.position_embedding_type != "rope":
        args.apply_rope_fusion = False
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    else:
        # With biases on, the QKV bias is on too (Megatron keeps the two flags in sync).
        args.add_qkv_bias = True
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size


def derive_model_shape(args: argparse.Namespace, problems: list) -> None:
    """Fills Megatron's derived model sizes and checks them against the parallel layout."""
    _derive_num_layers(args, problems)
    if _check_required_sizes(args, problems):
        _derive_widths(args, problems)
        _check_tensor_parallel_split(args, problems)
    _derive_sequence_lengths(args, problems)
    _sync_feature_flags(args, problems)


def check_recompute(args: argparse.Namespace, problems: list) -> None:
    """Activation recomputation: `full` needs a method and a layer count, `selective` takes neither."""
    if getattr(args, "recompute_activations", False):
        if args.recompute_granularity not in (None, "selective"):
            problems.append(f"--recompute-activations means selective recompute, but --recompute-granularity "
                            f"{args.recompute_granularity} was given")
        args.recompute_granularity = "selective"
    if hasattr(args, "recompute_activations"):
        del args.recompute_activations  # Megatron drops the shorthand once translated

    granularity, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if granularity == "full":
        if method is None:
            problems.append("--recompute-granularity full needs --recompute-method uniform or block")
        if layers is None:
            problems.append("--recompute-granularity full needs --recompute-num-layers")
        elif args.num_layers and args.pipeline_model_parallel_size >= 1:
            per_stage = args.num_layers // args.pipeline_model_parallel_size
            if not 1 <= layers <= per_stage:
                problems.append(f"--recompute-num-layers {layers} must be between 1 and the {per_stage} layers per "
                                f"pipeline stage (= --num-layers {args.num_layers} / PP "
                                f"{args.pipeline_model_parallel_size})")
    elif granularity == "selective":
        if method is not None:
            problems.append("--recompute-method applies to --recompute-granularity full only, not selective")
        if layers is not None:
            problems.append("--recompute-num-layers applies to --recompute-granularity full only, not selective")
    if args.distribute_saved_activations:
        if granularity != "full":
            problems.append("--distribute-saved-activations needs --recompute-granularity full")
        if args.sequence_parallel:
            problems.append("--distribute-saved-activations cannot be combined with --sequence-parallel")
