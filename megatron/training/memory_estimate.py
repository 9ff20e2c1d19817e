"""Parameters, memory per GPU and FLOPs of a GPT (dense or MoE) or T5 run, from its validated arguments alone
(no GPU, no model).

Parameters of one transformer layer (h hidden, q = kv_channels x heads, k = kv_channels x query groups,
f ffn, g = 2 with SwiGLU else 1; biases only with --add-bias-linear / --add-qkv-bias; LayerNorm has a
bias, RMSNorm not):

    norms 2h (+2h)   QKV h(q+2k) (+q+2k)   proj qh (+h)   fc1 h.f.g (+f.g)   fc2 f.h (+h)

(+ the q and k norms of kv_channels each with --qk-layernorm; + h.q and its bias in QKV with
--attention-output-gate). A Gated DeltaNet layer (--experimental-attention-variant, the layers
--linear-attention-freq picks; nk key heads of dk, nv value heads of dv, qk = nk.dk, v = nv.dv, kernel K) has
instead of QKV and proj, all split over TP but its output norm

    in_proj h(2qk + 2v + 2nv)   conv1d K(2qk + v)   A_log, dt_bias 2nv   out_proj v.h   out_norm dv (2dv) replicated

Multi-latent attention (n heads, d_nope + d_rope
query/key and d_v value channels, latents r_q and r_kv) has instead of QKV and proj

    q: h.r_q replicated + r_q.n(d_nope + d_rope) split (or h.n(d_nope + d_rope) split without r_q)
    kv: h(r_kv + d_rope) replicated + r_kv.n(d_nope + d_v) split      proj: n.d_v.h split
    norms (with --qk-layernorm) r_q + r_kv replicated

The QKV, proj, fc1 and fc2 weights and the column-parallel biases are split over TP; norms and the
row-parallel biases are replicated. Each of the --mtp-num-layers multi-token-prediction depths (last stage) is
a layer of the last layer's kind, eh_proj 2h.h (split) and three norms. Embeddings: V.h word (split over TP), max_pos.h learned positions;
the output layer is another V.h when untied (or, tied under PP, the last stage's copy of the embedding).

A MoE layer (--num-experts E, the layers --moe-layer-freq picks) has, instead of fc1/fc2, a router E.h
(replicated), E experts of h.f_e.g + f_e.h (split over EP x expert-TP) and, with
--moe-shared-expert-intermediate-size f_s, a shared MLP h.f_s.g + f_s.h (split over TP), and h replicated with
--moe-shared-expert-gate. A T5 (the entry
script's model type `encoder_and_decoder`) has --encoder-num-layers such layers, then --decoder-num-layers with a
cross-attention each (norm 2h, q h.q, kv 2.h.k, proj q.h, and their biases), a final norm after each
stack and the LM head's bias V. BERT's pooler, LM-head transform and token types (2h^2 + ~V) are not
counted (~0.6% of BERT-large); the banner counts the built model itself.

Bytes per parameter: weight 2 (fp16/bf16) or 4; gradient buffer 4 when gradients accumulate in fp32, else
2; optimizer: fp32 main copy 4 (mixed precision only) + Adam moments 8 (4 + 4; 2 each in bf16 with
--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16), SGD or Muon momentum 4, divided by
DP with the distributed optimizer (the routed experts' by expert-DP = world / (EP x expert-TP x PP)).
Megatron's classic "18 bytes per parameter" is 2 + 4 + 12; with bf16 moments it is 2 + 4 + 8. With FSDP2
sharding the params (--use-torch-fsdp2) the fp32 shards are the main
params: 4 (weight) + 4 (gradient) + the moments, all divided by DP x CP, and with
--torch-fsdp2-no-reshard-after-forward the weights gathered in the compute dtype (2 or 4) from forward to
backward on top; the gathered params of the one or two layers computing under ZeRO-3 are not counted.
With --fp8-param-gather the weights of the parallel linears in the layers that run in FP8 (QKV, projection,
fc1, fc2: the layers' TP-split parameters, their column-parallel biases counted with them) take 1 byte.
--use-megatron-fsdp optim_grads (ZeRO-2) is the distributed optimizer with an fp32 gradient shard (4 / DP x CP)
instead of the gradient buffer; its few buckets of gradients in flight during backward are not counted.
--use-megatron-fsdp optim_grads_params (ZeRO-3 on the same buffers) shards the weight too: 2 (bf16 shard) + 4 (fp32
gradient shard) + 12 bytes per parameter, all divided by DP x CP, plus the params it holds gathered at once (in the
weight dtype): those outside the transformer layers (kept from forward to backward) and two buckets of layers
(the one computing, the one prefetched; a bucket is ceil(bucket size / layer parameters) whole layers); on one
data-parallel rank the shard is the whole buffer and nothing more is gathered.

Activations of one microbatch, per layer, counted from what this implementation keeps for backward
(s sequence, b micro batch, B bytes of the activation dtype; masks are 1 byte; fused SDPA attention keeps
no s x s matrix):

    replicated over TP (split with --sequence-parallel):
        norm inputs and outputs 4 . s.b.h.B    + 2 hidden-dropout masks (kept in the activation dtype) 2 . s.b.h.B
        multi-latent attention's latents (`_attention_activation_widths`)
    split over TP:
        the fused QKV output and the attention output (q + 2k + q)/h . s.b.h.B, more with RoPE, --qk-layernorm
        and multi-latent attention (`_attention_activation_widths`)
        fc1 output and activation output (f.g + f)/h . s.b.h.B, with SwiGLU also SiLU(a) and its sigmoid 2f/h

Measured on CPU with saved-tensor hooks, this is exactly what a layer keeps. Backward adds a working set
of about two fc1-sized gradients (2 . s.b.f.g/TP . B). With full recomputation a layer keeps only its
input (s.b.h.B) and one layer at a time is rebuilt in backward. Outside the layers: the embedding output
and its dropout mask, the final norm output, the logits and their fp32 softmax for the loss (s.b.V/TP x
(B + 4 + 4): logits, softmax, and the gradient of the logits made in backward). The first pipeline stage
holds min(PP, microbatches) microbatches in flight (1F1B). Not modelled: attention dropout where SDPA has
no fused kernel that applies it (the CPU), which then keeps s x s probabilities per head.

With context parallelism (CP ranks) each rank holds s / CP of the sequence: every count above takes s / CP,
and a layer keeps the keys and values of the other ranks its attention used: with the ring (p2p) the one
block its forward received last (2k . s/CP . b . B / TP, kept for the backward's first step), with
all-gather the gathered sequence (2k . s . b . B / TP). A list of types per layer counts each layer by its own.

A MoE layer keeps, instead of the MLP's, for its t.topk/EP routed rows (balanced routing): the permuted
input, the experts' fc1 and activation outputs, the expert output before and after weighting, and the
router's fp32 logits and probabilities (measured on CPU: within 1% of what the layer saves), and its shared
expert's MLP activations. Each multi-token-prediction depth keeps a layer's activations, its embedding, norm
and eh_proj inputs (5 . s.b.h.B) and its logits. A T5 decoder
layer also keeps its cross-attention's norm, q, k, v (over the encoder's tokens) and output; T5's
activations are this model's arithmetic, not checked against a measurement. Gated DeltaNet layers are
counted with a softmax-attention layer's activations (theirs are not modelled yet).
"""

import math
from dataclasses import dataclass

from megatron.core.distributed.distributed_data_parallel import default_bucket_size
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import shards_params, shards_params_on_buffers
from megatron.core.enums import ModelType
from megatron.core.transformer.config_rules import linear_attention_pattern
from megatron.core.transformer.context_parallel import cp_comm_type_of_layer
from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
from megatron.training.arguments.core_configs import ddp_config_from_args

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


def _norm(args) -> int:
    return args.hidden_size if args.normalization == "RMSNorm" else 2 * args.hidden_size


def _mlp_parameters(args, ffn: int) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one MLP of width `ffn`."""
    h, gate = args.hidden_size, 2 if args.swiglu else 1
    split, replicated = h * ffn * gate + ffn * h, 0
    if args.add_bias_linear:
        split, replicated = split + ffn * gate, h
    return split, replicated


def _query_key_widths(args) -> tuple[int, int]:
    """(q, k): the query width kv_channels x heads and the key (or value) width kv_channels x query groups."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    return args.kv_channels * heads, args.kv_channels * groups


def _latent_attention_parameters(args) -> tuple[int, int]:
    """(split over TP, replicated) parameters of multi-latent attention (module docstring)."""
    h, heads, rope, latent = args.hidden_size, args.num_attention_heads, args.qk_pos_emb_head_dim, args.kv_lora_rank
    q_head = args.qk_head_dim + rope
    split = latent * heads * (args.qk_head_dim + args.v_head_dim) + heads * args.v_head_dim * h
    replicated = h * (latent + rope)
    norms = latent
    if args.q_lora_rank is None:
        split += h * heads * q_head
    else:
        split += args.q_lora_rank * heads * q_head
        replicated += h * args.q_lora_rank
        norms += args.q_lora_rank
    if args.qk_layernorm:
        replicated += norms * (1 if args.normalization == "RMSNorm" else 2)
    return split, replicated


def _attention_parameters(args) -> tuple[int, int]:
    """(split over TP, replicated) parameters of a layer's self-attention, biases and q/k norms included."""
    if getattr(args, "multi_latent_attention", False):
        split, replicated = _latent_attention_parameters(args)
        return split, replicated + (args.hidden_size if args.add_bias_linear else 0)
    h = args.hidden_size
    q, k = _query_key_widths(args)
    split, replicated = h * (q + 2 * k) + q * h, 0
    if args.add_bias_linear:
        split += q + 2 * k
        replicated += h
    elif getattr(args, "add_qkv_bias", False):
        split += q + 2 * k
    if args.qk_layernorm:  # one norm of kv_channels for the query heads, one for the key heads
        replicated += 2 * args.kv_channels * (1 if args.normalization == "RMSNorm" else 2)
    if getattr(args, "attention_output_gate", False):  # a gate row per query row
        split += h * q + (q if args.add_bias_linear or getattr(args, "add_qkv_bias", False) else 0)
    return split, replicated


def _linear_attention_parameters(args) -> tuple[int, int]:
    """(split over TP, replicated) parameters of a Gated DeltaNet layer's attention (module docstring)."""
    h, heads, value_head = args.hidden_size, args.linear_num_value_heads, args.linear_value_head_dim
    qk, v = args.linear_num_key_heads * args.linear_key_head_dim, heads * value_head
    split = h * (2 * qk + 2 * v + 2 * heads) + args.linear_conv_kernel_dim * (2 * qk + v) + 2 * heads + v * h
    return split, value_head * (1 if args.normalization == "RMSNorm" else 2)


def _layer_parameters(args, moe: bool = False, cross_attention: bool = False,
                      linear_attention: bool = False) -> tuple[int, int, int]:
    """(split over TP, replicated, split over EP x expert-TP) parameters of one transformer layer."""
    h = args.hidden_size
    q, k = _query_key_widths(args)
    split, replicated = _linear_attention_parameters(args) if linear_attention else _attention_parameters(args)
    replicated += 2 * _norm(args)
    if cross_attention:  # T5 decoder: q from the decoder, k and v from the encoder output
        split += h * q + 2 * h * k + q * h + ((q + 2 * k) if args.add_bias_linear else 0)
        replicated += _norm(args) + (h if args.add_bias_linear else 0)
    experts = 0
    if moe:
        replicated += args.num_experts * h
        experts = args.num_experts * sum(_mlp_parameters(args, args.moe_ffn_hidden_size))
        if args.moe_shared_expert_intermediate_size:
            shared_split, shared_replicated = _mlp_parameters(args, args.moe_shared_expert_intermediate_size)
            split, replicated = split + shared_split, replicated + shared_replicated
            replicated += h if getattr(args, "moe_shared_expert_gate", False) else 0
    else:
        mlp_split, mlp_replicated = _mlp_parameters(args, args.ffn_hidden_size)
        split, replicated = split + mlp_split, replicated + mlp_replicated
    return split, replicated, experts


def _encoder_and_decoder(args) -> bool:
    """A T5: `pretrain()` records the entry script's model type in args.model_type, as Megatron-LM does."""
    return getattr(args, "model_type", None) is ModelType.encoder_and_decoder


def _layers(args) -> list[tuple[int, int, int]]:
    """`_layer_parameters` of every layer in order (a T5's encoder layers, then its decoder layers)."""
    if _encoder_and_decoder(args):
        decoder_layers = args.decoder_num_layers or args.encoder_num_layers
        return [_layer_parameters(args)] * args.encoder_num_layers + [
            _layer_parameters(args, cross_attention=True)] * decoder_layers
    moe = moe_layer_pattern(args.num_layers, args.moe_layer_freq) if args.num_experts else [0] * args.num_layers
    linear = linear_attention_pattern(args.num_layers, args.experimental_attention_variant, args.linear_attention_freq)
    return [_layer_parameters(args, moe=is_moe, linear_attention=is_linear) for is_moe, is_linear in zip(moe, linear)]


def _embedding_parameters(args) -> tuple[int, int]:
    """(word embedding, position embedding) parameters of the whole model."""
    positions = args.max_position_embeddings * args.hidden_size
    return args.padded_vocab_size * args.hidden_size, positions if args.position_embedding_type == "learned_absolute" else 0


def _outside_layers(args) -> tuple[int, int]:
    """(final norms, output layer and LM-head bias) parameters of the whole model."""
    words, _ = _embedding_parameters(args)
    if _encoder_and_decoder(args):
        return 2 * _norm(args), args.padded_vocab_size + (words if args.untie_embeddings_and_output_weights else 0)
    return _norm(args), words if args.untie_embeddings_and_output_weights else 0


def _mtp_parameters(args) -> tuple[int, int, int]:
    """(split over TP, replicated, split over EP x expert-TP) parameters of the multi-token-prediction depths:
    each a layer of the last layer's kind, eh_proj 2h.h and three norms (enorm, hnorm, final)."""
    depths = getattr(args, "mtp_num_layers", None) or 0
    if not depths:
        return 0, 0, 0
    split, replicated, experts = _layers(args)[-1]
    h = args.hidden_size
    return depths * (split + 2 * h * h), depths * (replicated + 3 * _norm(args)), depths * experts


def total_parameters(args) -> int:
    """Parameters of the whole model, each counted once."""
    words, positions = _embedding_parameters(args)
    norms, output = _outside_layers(args)
    return sum(map(sum, _layers(args))) + sum(_mtp_parameters(args)) + words + positions + norms + output


def _experts_share(args) -> int:
    """The ranks the routed experts are split over: EP x expert-TP."""
    return args.expert_model_parallel_size * (args.expert_tensor_parallel_size or args.tensor_model_parallel_size)


def _layer_parameters_per_rank(args, layer: tuple[int, int, int], dense: int = 1) -> int:
    """Parameters of one layer (`_layer_parameters`) on one TP (and EP) rank; `dense` 0: the routed experts'."""
    split, replicated, experts = layer
    return dense * (split // args.tensor_model_parallel_size + replicated) + experts // _experts_share(args)


def _first_stage_layers(args) -> list[tuple[int, int, int]]:
    """`_layer_parameters` of the layers of the first pipeline stage."""
    return _layers(args)[: args.num_layers // args.pipeline_model_parallel_size]


def parameters_per_rank(args, experts_only: bool = False) -> dict:
    """{"first stage": n, "last stage": n} parameters on one TP (and EP) rank of the first and last pipeline
    stages (T5 runs at PP 1); with `experts_only` those of the routed experts alone."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dense = 0 if experts_only else 1
    layers = _layers(args)
    per_stage = len(layers) // pp

    def stage(index: int) -> int:
        return sum(_layer_parameters_per_rank(args, layer, dense)
                   for layer in layers[index * per_stage:(index + 1) * per_stage])

    words, positions = _embedding_parameters(args)
    norms, output = _outside_layers(args)
    mtp_split, mtp_replicated, mtp_experts = _mtp_parameters(args)
    # The last stage's:
    norms = dense * (norms + mtp_split // tp + mtp_replicated) + mtp_experts // _experts_share(args)
    first = stage(0) + dense * (words // tp + positions)
    last_output = dense * (output // tp if (output or pp == 1) else words // tp)  # tied under PP: the last copy
    if output and pp > 1 and mtp_split:  # untied: MTP's copy of the word embedding on the last stage too
        last_output += dense * words // tp
    if pp == 1:
        return {"first stage": first + norms + last_output, "last stage": first + norms + last_output}
    return {"first stage": first, "last stage": stage(pp - 1) + norms + last_output}


def _routed_rows(args, tokens: int) -> int:
    """Rows an expert-parallel rank's experts compute for `tokens` tokens (top-k copies, balanced routing)."""
    return tokens * args.moe_router_topk // args.expert_model_parallel_size


def _context_parallel_keys(args, tokens: int, layer_index: int) -> int:
    """Elements per key/value width that layer `layer_index` (0-based) keeps of the other CP ranks' keys and
    values for `tokens` tokens of this rank (module docstring)."""
    cp = args.context_parallel_size
    if cp == 1:
        return 0
    types = args.cp_comm_type[0] if len(args.cp_comm_type) == 1 else args.cp_comm_type
    return tokens * (cp if cp_comm_type_of_layer(types, layer_index + 1) == "all_gather" else 1)


def _layer_activation_bytes(args, tokens: int, moe: bool = False, encoder_tokens: int = 0,
                            layer_index: int = 0) -> int:
    """Bytes one layer keeps for backward for `tokens` tokens of a microbatch on this rank (module docstring);
    a T5 decoder layer's cross-attention over `encoder_tokens` adds its norm, q, k, v and output."""
    h, B = args.hidden_size, 2 if (args.fp16 or args.bf16) else 4
    tp = args.tensor_model_parallel_size
    q, k = _query_key_widths(args)
    replicated_share = tp if args.sequence_parallel else 1
    masks = 2 * tokens * h * B if args.hidden_dropout > 0 else 0
    attention_split, attention_replicated = _attention_activation_widths(args)
    kept = (4 * tokens * h * B + masks + tokens * attention_replicated * B) // replicated_share
    kept += tokens * attention_split * B // tp
    kept += 2 * k * _context_parallel_keys(args, tokens, layer_index) * B // tp
    if encoder_tokens:
        kept += (2 * tokens * h * B + (masks // 2)) // replicated_share
        kept += (tokens * 2 * q + encoder_tokens * 2 * k) * B // tp
    if moe:
        # Routed rows t.topk/EP (balanced routing): the permuted input, the experts' fc1 and activation outputs
        # (width f_e over expert-TP; SwiGLU keeps one more), the expert output before and after weighting
        # ([rows, h] each), the router's fp32 logits and probabilities.
        f, rows = args.moe_ffn_hidden_size, _routed_rows(args, tokens)
        gate = 2 if args.swiglu else 1
        kept += rows * (f * gate + f + (f if args.swiglu else 0)) * B // (args.expert_tensor_parallel_size or tp)
        kept += 3 * rows * h * B + 2 * tokens * args.num_experts * 4
        if args.moe_shared_expert_intermediate_size:
            kept += tokens * _mlp_activation_width(args, args.moe_shared_expert_intermediate_size) * B // tp
    else:
        kept += tokens * _mlp_activation_width(args, args.ffn_hidden_size) * B // tp
    return kept


def _mlp_activation_width(args, f: int) -> int:
    """Kept width of an MLP of width f: fc1 and activation outputs; with SwiGLU also SiLU(a) and its sigmoid,
    beside a, b and SiLU(a) * b."""
    return 5 * f if args.swiglu else 2 * f


def _attention_activation_widths(args) -> tuple[int, int]:
    """(split over TP, replicated over TP) widths per token that a layer's self-attention keeps.

    Standard: the fused QKV output (q + 2k, alive through the value view), with --qk-layernorm the query heads
    gathered out of it and the normalised q and k (2q + k), the rotated q and k with RoPE, the output q. Multi-latent attention (n heads of
    d = d_nope + d_rope; values zero-padded to d for core attention): query, key, padded value and padded
    output [n.d] each, the output cut to [n.d_v]; replicated, the q latent and the kv latent with k_rope
    (r_q + r_kv + d_rope), and with --qk-layernorm the norms' outputs (r_q + r_kv)."""
    if getattr(args, "multi_latent_attention", False):
        heads, q_head = args.num_attention_heads, args.qk_head_dim + args.qk_pos_emb_head_dim
        latents = args.kv_lora_rank + args.qk_pos_emb_head_dim + (args.q_lora_rank or 0)
        normed = (args.kv_lora_rank + (args.q_lora_rank or 0)) if args.qk_layernorm else 0
        return heads * (4 * q_head + args.v_head_dim), latents + normed
    q, k = _query_key_widths(args)
    normed = 2 * q + k if args.qk_layernorm else 0
    rotated = q + k if args.position_embedding_type == "rope" else 0
    return q + 2 * k + normed + rotated + q, 0


def _activation_bytes(args) -> tuple[int, int]:
    """(no recompute, full recompute) activation bytes of one microbatch on the first stage."""
    b, h = args.micro_batch_size, args.hidden_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    B = 2 if (args.fp16 or args.bf16) else 4
    replicated_share = tp if args.sequence_parallel else 1
    tokens = args.seq_length // args.context_parallel_size * b  # this rank's part of the sequence
    if _encoder_and_decoder(args):
        decoder_tokens = args.decoder_seq_length * b
        layers = [_layer_activation_bytes(args, tokens)] * args.encoder_num_layers + [
            _layer_activation_bytes(args, decoder_tokens, encoder_tokens=tokens)] * (
            args.decoder_num_layers or args.encoder_num_layers)
        inputs = (args.encoder_num_layers * tokens + (len(layers) - args.encoder_num_layers) * decoder_tokens) * h * B
        moe_layers = []
    else:
        moe_layers = [parameters[2] > 0 for parameters in _first_stage_layers(args)]
        layers = [_layer_activation_bytes(args, tokens, moe=moe, layer_index=index)
                  for index, moe in enumerate(moe_layers)]
        decoder_tokens, inputs = tokens, len(layers) * tokens * h * B
    # Backward's working set: about two gradients of the largest fc1 output (dense, or the routed rows').
    gate = 2 if args.swiglu else 1
    dense_layers = not moe_layers or not all(moe_layers)
    backward_working_set = 2 * tokens * args.ffn_hidden_size * gate * B // tp if dense_layers else 0
    if any(moe_layers):
        backward_working_set = max(backward_working_set, 2 * _routed_rows(args, tokens) * args.moe_ffn_hidden_size
                                   * gate * B // (args.expert_tensor_parallel_size or tp))
    logits = decoder_tokens * args.padded_vocab_size // tp * (B + 4 + 4) if pp == 1 else 0
    outside = 3 * tokens * h * B + logits + backward_working_set
    depths = getattr(args, "mtp_num_layers", None) or 0
    if depths and pp == 1:  # each depth: a layer, its embedding, norms and eh_proj input (5 t.h), its logits
        outside += depths * (_layer_activation_bytes(args, tokens, moe=bool(moe_layers and moe_layers[-1]))
                             + 5 * tokens * h * B // replicated_share + logits)
    full = inputs // replicated_share + max(layers) + outside
    return sum(layers) + outside, full


def _fp8_weight_elements(args) -> int:
    """Elements of the weights stored in FP8 (--fp8-param-gather) on a first-stage rank: the TP-split parameters
    of its layers that run in FP8 (--first-last-layers-bf16 keeps some out)."""
    if not (args.fp8 and args.fp8_param_gather):
        return 0
    start, end = 0, args.num_layers
    if args.first_last_layers_bf16:
        start, end = args.num_layers_at_start_in_bf16, args.num_layers - args.num_layers_at_end_in_bf16
    return sum(split // args.tensor_model_parallel_size
               for index, (split, _, _) in enumerate(_first_stage_layers(args)) if start <= index < end)


def _gathered_under_zero3(args, ddp_config, parameters: int) -> int:
    """Parameters of the first stage that ZeRO-3 on DDP's buffers holds gathered at once (module docstring); none
    on one data-parallel rank, whose shard is the whole bucket."""
    if args.data_parallel_size * args.context_parallel_size == 1:
        return 0
    stage = _first_stage_layers(args)
    if not stage:
        return parameters
    per_layer = [_layer_parameters_per_rank(args, layer) for layer in stage]
    bucket = default_bucket_size(ddp_config, args.data_parallel_size) or sum(per_layer)
    layers_per_bucket = min(len(stage), math.ceil(bucket / max(per_layer)))
    return parameters - sum(per_layer) + min(2 * layers_per_bucket, len(stage)) * max(per_layer)


def estimate_memory(args, num_microbatches: int) -> MemoryEstimate:
    """Memory per GPU of the first pipeline stage (see the module docstring for the model)."""
    parameters = parameters_per_rank(args)["first stage"]
    mixed = args.fp16 or args.bf16
    grad_bytes = 4 if (not mixed or args.accumulate_allreduce_grads_in_fp32) else 2
    if args.optimizer == "adam":
        state_bytes = args.exp_avg_dtype.itemsize + args.exp_avg_sq_dtype.itemsize
    elif args.optimizer == "muon":  # the momentum of the weight matrices (Adam's 8 for the few others)
        state_bytes = 4
    else:
        state_bytes = 4 if args.sgd_momentum else 0
    optimizer = parameters * (state_bytes + (4 if mixed else 0))
    weight_bytes = 2 if mixed else 4
    weights, gradients = parameters * weight_bytes, parameters * grad_bytes
    weights -= _fp8_weight_elements(args) * (weight_bytes - 1)
    if args.use_distributed_optimizer:  # dense state sharded over DP, the experts' over expert-DP
        experts = parameters_per_rank(args, experts_only=True)["first stage"]
        expert_data_parallel = args.world_size // (_experts_share(args) * args.pipeline_model_parallel_size)
        per_parameter = state_bytes + (4 if mixed else 0)
        optimizer = ((parameters - experts) * per_parameter // args.data_parallel_size
                     + experts * per_parameter // max(expert_data_parallel, 1))
    ddp_config = ddp_config_from_args(args)
    shards = args.data_parallel_size * args.context_parallel_size
    if ddp_config.use_megatron_fsdp and ddp_config.data_parallel_sharding_strategy.startswith("optim_grads"):
        gradients = parameters * 4 // shards
    if shards_params_on_buffers(ddp_config):
        weights = (parameters * weight_bytes // shards
                   + _gathered_under_zero3(args, ddp_config, parameters) * weight_bytes)
    if shards_params(ddp_config):
        gathered = 0 if ddp_config.reshard_after_forward else weights
        weights, gradients = parameters * 4 // shards + gathered, parameters * 4 // shards
        optimizer = parameters * state_bytes // shards
    in_flight = min(args.pipeline_model_parallel_size, num_microbatches)
    activations, full = _activation_bytes(args)
    return MemoryEstimate(
        parameters=parameters,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations * in_flight,
        activations_full_recompute=full * in_flight,
    )
