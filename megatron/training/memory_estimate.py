"""Parameters, memory per GPU and FLOPs of a GPT run, from its validated arguments alone (no GPU, no model).

Parameters of one transformer layer (h hidden, q = kv_channels x heads, k = kv_channels x query groups,
f ffn, g = 2 with SwiGLU else 1; biases only with --add-bias-linear / --add-qkv-bias; LayerNorm has a
bias, RMSNorm not):

    norms 2h (+2h)   QKV h(q+2k) (+q+2k)   proj qh (+h)   fc1 h.f.g (+f.g)   fc2 f.h (+h)

The QKV, proj, fc1 and fc2 weights and the column-parallel biases are split over TP; norms and the
row-parallel biases are replicated. Embeddings: V.h word (split over TP), max_pos.h learned positions;
the output layer is another V.h when untied (or, tied under PP, the last stage's copy of the embedding).

Bytes per parameter: weight 2 (fp16/bf16) or 4; gradient buffer 4 when gradients accumulate in fp32, else
2; optimizer: fp32 main copy 4 (mixed precision only) + Adam moments 8 (SGD momentum 4), divided by DP
with the distributed optimizer. Megatron's classic "18 bytes per parameter" is 2 + 4 + 12.

Activations of one microbatch, per layer, counted from what this implementation keeps for backward
(s sequence, b micro batch, B bytes of the activation dtype; masks are 1 byte; fused SDPA attention keeps
no s x s matrix):

    replicated over TP (split with --sequence-parallel):
        norm inputs and outputs 4 . s.b.h.B    + 2 hidden-dropout masks (kept in the activation dtype) 2 . s.b.h.B
    split over TP:
        q, k, v and the attention output (q + 2k + q)/h . s.b.h.B
        fc1 output and activation output (f.g + f)/h . s.b.h.B, with SwiGLU also SiLU(a) and its sigmoid 2f/h

Measured on CPU with saved-tensor hooks, this is exactly what a layer keeps. Backward adds a working set
of about two fc1-sized gradients (2 . s.b.f.g/TP . B). With full recomputation a layer keeps only its
input (s.b.h.B) and one layer at a time is rebuilt in backward. Outside the layers: the embedding output
and its dropout mask, the final norm output, the logits and their fp32 softmax for the loss (s.b.V/TP x
(B + 4 + 4): logits, softmax, and the gradient of the logits made in backward). The first pipeline stage
holds min(PP, microbatches) microbatches in flight (1F1B). Not modelled: attention dropout where SDPA has
no fused kernel that applies it (the CPU), which then keeps s x s probabilities per head.
"""

from dataclasses import dataclass

GIB = 1024**3


def format_bytes(value: int) -> str:
    """`1.50 GiB`, or MiB below one GiB."""
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / 1024**2:.2f} MiB"


@dataclass
class MemoryEstimate:
    """Bytes per GPU of the most loaded rank (the first pipeline stage holding the embedding)."""

    parameters: int  # on that rank
    weights: int
    gradients: int
    optimizer: int
    activations: int  # without recomputation
    activations_full_recompute: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def total_full_recompute(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations_full_recompute


def _layer_parameters(args) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one transformer layer."""
    h, f = args.hidden_size, args.ffn_hidden_size
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    q, k = args.kv_channels * heads, args.kv_channels * groups
    gate = 2 if args.swiglu else 1
    norm = h if args.normalization == "RMSNorm" else 2 * h
    split = h * (q + 2 * k) + q * h + h * f * gate + f * h
    replicated = 2 * norm
    if args.add_bias_linear:
        split += (q + 2 * k) + f * gate
        replicated += 2 * h
    elif getattr(args, "add_qkv_bias", False):
        split += q + 2 * k
    return split, replicated


def _embedding_parameters(args) -> tuple[int, int]:
    """(word embedding, position embedding) parameters of the whole model."""
    positions = args.max_position_embeddings * args.hidden_size
    return args.padded_vocab_size * args.hidden_size, positions if args.position_embedding_type == "learned_absolute" else 0


def total_parameters(args) -> int:
    """Parameters of the whole model, each counted once."""
    split, replicated = _layer_parameters(args)
    words, positions = _embedding_parameters(args)
    final_norm = args.hidden_size if args.normalization == "RMSNorm" else 2 * args.hidden_size
    output = words if args.untie_embeddings_and_output_weights else 0
    return args.num_layers * (split + replicated) + words + positions + final_norm + output


def parameters_per_rank(args) -> dict:
    """{"first stage": n, "last stage": n} parameters on one TP rank of the first and last pipeline stages."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    split, replicated = _layer_parameters(args)
    words, positions = _embedding_parameters(args)
    layers = args.num_layers // pp * (split // tp + replicated)
    final_norm = args.hidden_size if args.normalization == "RMSNorm" else 2 * args.hidden_size
    first = layers + words // tp + positions
    last_output = words // tp if (args.untie_embeddings_and_output_weights or pp > 1) else 0
    if pp == 1:
        return {"first stage": first + final_norm + last_output, "last stage": first + final_norm + last_output}
    return {"first stage": first, "last stage": layers + final_norm + last_output}


def _activation_bytes(args) -> tuple[int, int]:
    """(no recompute, full recompute) activation bytes of one microbatch on the first stage."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    B = 2 if (args.fp16 or args.bf16) else 4
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    q, k = args.kv_channels * heads, args.kv_channels * groups
    gate = 2 if args.swiglu else 1
    f = args.ffn_hidden_size
    tokens = s * b
    replicated_share = tp if args.sequence_parallel else 1
    masks = 2 * tokens * h * B if args.hidden_dropout > 0 else 0
    per_layer = (4 * tokens * h * B + masks) // replicated_share
    swiglu_extra = 2 * f if args.swiglu else 0  # SiLU(a) and its sigmoid, beside a, b and SiLU(a) * b
    per_layer += tokens * ((q + 2 * k + q) + (f * gate + f + swiglu_extra)) * B // tp
    layers = args.num_layers // pp
    backward_working_set = 2 * tokens * f * gate * B // tp
    logits = tokens * args.padded_vocab_size // tp * (B + 4 + 4) if pp == 1 else 0
    outside = 3 * tokens * h * B + logits + backward_working_set
    full = layers * tokens * h * B // replicated_share + per_layer + outside
    return layers * per_layer + outside, full


def estimate_memory(args, num_microbatches: int) -> MemoryEstimate:
    """Memory per GPU of the first pipeline stage (see the module docstring for the model)."""
    parameters = parameters_per_rank(args)["first stage"]
    mixed = args.fp16 or args.bf16
    grad_bytes = 4 if (not mixed or args.accumulate_allreduce_grads_in_fp32) else 2
    state_bytes = 8 if args.optimizer == "adam" else (4 if args.sgd_momentum else 0)
    optimizer = parameters * (state_bytes + (4 if mixed else 0))
    if args.use_distributed_optimizer:
        optimizer //= args.data_parallel_size
    in_flight = min(args.pipeline_model_parallel_size, num_microbatches)
    activations, full = _activation_bytes(args)
    return MemoryEstimate(
        parameters=parameters,
        weights=parameters * (2 if mixed else 4),
        gradients=parameters * grad_bytes,
        optimizer=optimizer,
        activations=activations * in_flight,
        activations_full_recompute=full * in_flight,
    )
