"""The message stream between a convert.py loader and saver (Megatron's protocol, reference 8.3).

A loader sends, in this order: one metadata Namespace (`metadata_from_args`), then the full, unsharded
model as messages, then "done" ("exit" if it failed):

    {"name": "embeddings", "word embeddings", "position embeddings" (learned positions only)}
    {"name": "transformer layer N", "input norm weight/bias", "qkv weight/bias", "dense weight/bias",
     "post norm weight/bias", "mlp l0 weight" (SwiGLU: "mlp l0 weight W" = gate, "mlp l0 weight V" = up),
     "mlp l0 bias" (SwiGLU: "... bias W/V"), "mlp l1 weight/bias"}     (biases only where the model has them)
     MoE layers instead of the MLP: "router weight" [E, h], and the experts stacked in expert order,
     "mlp l0 weight" [E, f, h] (SwiGLU: "mlp l0 weight W"/"V") and "mlp l1 weight" [E, h, f]; with shared
     experts "shared mlp l0 weight" ([gate; up] whole) and "shared mlp l1 weight"; with an expert bias
     "router bias" [E]
     Extensions of this project: "q norm weight", "k norm weight" (--qk-layernorm); multi-latent attention
     instead of "qkv weight": "q weight" or "q down weight", "q norm weight", "q up weight", then
     "kv down weight", "kv norm weight", "kv up weight"
    {"name": "final norm", "weight", "bias" (LayerNorm only)}
    {"name": "output layer", "weight"}                                  (untied models only)
    {"name": "mtp layer K", <key under mtp.layers.K.>: tensor, ...}      (--mtp-num-layers: K = 0 .. D-1)

Word embeddings and output layer carry the rows the source had (padded or not); the saver pads or
trims them. `state_to_messages` / `messages_to_state` translate to and from a full Megatron-Core state
dict; the table `_LAYER_KEYS` is the one name map.
"""

import argparse

import torch

from megatron.training.checkpointing.conversion.gpt_shape import GPTShape

# Megatron's message key -> Megatron-Core parameter under decoder.layers.N (fc1 handled apart for SwiGLU).
_LAYER_KEYS = {
    "input norm weight": "input_layernorm.weight",
    "input norm bias": "input_layernorm.bias",
    "qkv weight": "self_attention.linear_qkv.weight",
    "qkv bias": "self_attention.linear_qkv.bias",
    "dense weight": "self_attention.linear_proj.weight",
    "dense bias": "self_attention.linear_proj.bias",
    "post norm weight": "pre_mlp_layernorm.weight",
    "post norm bias": "pre_mlp_layernorm.bias",
    "mlp l0 weight": "mlp.linear_fc1.weight",
    "mlp l0 bias": "mlp.linear_fc1.bias",
    "mlp l1 weight": "mlp.linear_fc2.weight",
    "mlp l1 bias": "mlp.linear_fc2.bias",
    # per-head q/k norms (--qk-layernorm), or the latent norms of multi-latent attention
    "q norm weight": "self_attention.q_layernorm.weight",
    "k norm weight": "self_attention.k_layernorm.weight",
    # multi-latent attention (--multi-latent-attention)
    "q weight": "self_attention.linear_q_proj.weight",
    "q down weight": "self_attention.linear_q_down_proj.weight",
    "q up weight": "self_attention.linear_q_up_proj.weight",
    "kv down weight": "self_attention.linear_kv_down_proj.weight",
    "kv norm weight": "self_attention.kv_layernorm.weight",
    "kv up weight": "self_attention.linear_kv_up_proj.weight",
    # MoE layers: shared experts (fc1 = [gate; up] whole) and the expert bias of aux-loss-free balancing
    "shared mlp l0 weight": "mlp.shared_experts.linear_fc1.weight",
    "shared mlp l1 weight": "mlp.shared_experts.linear_fc2.weight",
    "router bias": "mlp.router.expert_bias",
}
_FC1_KEYS = ("mlp l0 weight", "mlp l0 bias")
_ROUTER = "mlp.router.weight"


def metadata_from_args(args: argparse.Namespace, shape: GPTShape, iteration: int, release: bool) -> argparse.Namespace:
    """Megatron's metadata Namespace; `checkpoint_args` carries the full training arguments."""
    return argparse.Namespace(
        model_type="GPT", num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        seq_length=getattr(args, "seq_length", None), num_attention_heads=shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings, tokenizer_type=getattr(args, "tokenizer_type", None),
        iteration=iteration, release=release, params_dtype=shape.params_dtype, true_vocab_size=shape.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        consumed_train_samples=getattr(args, "consumed_train_samples", 0),
        consumed_valid_samples=getattr(args, "consumed_valid_samples", 0),
        swiglu=shape.swiglu, linear_bias=shape.add_bias_linear, qkv_bias=shape.qkv_bias, num_experts=shape.num_experts,
        norm_has_bias=shape.norm_has_bias, position_embedding_type=shape.position_embedding_type,
        output_layer=not shape.tied_embeddings,
        previous_tensor_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        previous_pipeline_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
        previous_expert_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        checkpoint_args=args, shape=shape,
    )


def _expert_key(prefix: str, expert: int, linear: str) -> str:
    return f"{prefix}mlp.experts.local_experts.{expert}.{linear}.weight"


def _moe_message(state: dict, prefix: str, shape: GPTShape) -> dict:
    """The router and the experts of one MoE layer, stacked in expert order."""
    fc1 = [state[_expert_key(prefix, expert, "linear_fc1")] for expert in range(shape.num_experts)]
    message = {"router weight": state[prefix + _ROUTER],
               "mlp l1 weight": torch.stack([state[_expert_key(prefix, expert, "linear_fc2")]
                                             for expert in range(shape.num_experts)])}
    if shape.swiglu:
        message["mlp l0 weight W"] = torch.stack([torch.chunk(weight, 2, dim=0)[0] for weight in fc1])
        message["mlp l0 weight V"] = torch.stack([torch.chunk(weight, 2, dim=0)[1] for weight in fc1])
    else:
        message["mlp l0 weight"] = torch.stack(fc1)
    return message


def _moe_state(message: dict, prefix: str, shape: GPTShape, checking: bool) -> dict:
    """Inverse of `_moe_message`."""
    state = {prefix + _ROUTER: _take(message, "router weight", checking)}
    if shape.swiglu:
        fc1 = torch.cat([_take(message, "mlp l0 weight W", checking), _take(message, "mlp l0 weight V", checking)],
                        dim=1)
    else:
        fc1 = _take(message, "mlp l0 weight", checking)
    fc2 = _take(message, "mlp l1 weight", checking)
    for expert in range(shape.num_experts):
        state[_expert_key(prefix, expert, "linear_fc1")] = fc1[expert]
        state[_expert_key(prefix, expert, "linear_fc2")] = fc2[expert]
    return state


def _layer_message(state: dict, i: int, shape: GPTShape) -> dict:
    prefix = f"decoder.layers.{i}."
    message = {"name": f"transformer layer {i}"}
    for key, suffix in _LAYER_KEYS.items():
        if prefix + suffix not in state:
            continue
        if shape.swiglu and key in _FC1_KEYS:
            message[f"{key} W"], message[f"{key} V"] = torch.chunk(state[prefix + suffix], 2, dim=0)
        else:
            message[key] = state[prefix + suffix]
    if shape.moe_layers and shape.moe_layers[i]:
        message.update(_moe_message(state, prefix, shape))
    return message


def state_to_messages(state: dict, shape: GPTShape):
    """The messages (without metadata and "done") of a full GPTModel state dict, one at a time."""
    embeddings = {"name": "embeddings", "word embeddings": state["embedding.word_embeddings.weight"]}
    if "embedding.position_embeddings.weight" in state:
        embeddings["position embeddings"] = state["embedding.position_embeddings.weight"]
    yield embeddings
    for i in range(shape.num_layers):
        yield _layer_message(state, i, shape)
    final_norm = {"name": "final norm", "weight": state["decoder.final_layernorm.weight"]}
    if "decoder.final_layernorm.bias" in state:
        final_norm["bias"] = state["decoder.final_layernorm.bias"]
    yield final_norm
    if not shape.tied_embeddings:
        yield {"name": "output layer", "weight": state["output_layer.weight"]}
    for depth in range(shape.mtp_num_layers or 0):
        prefix = f"mtp.layers.{depth}."
        yield {"name": f"mtp layer {depth}",
               **{name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}}


def _expect(message, name: str, checking: bool) -> dict:
    if message == "exit":
        raise RuntimeError("the loader failed (it sent 'exit'); see its error above")
    if checking and (not isinstance(message, dict) or message.get("name") != name):
        got = message.get("name") if isinstance(message, dict) else message
        raise ValueError(f"convert.py message order: expected {name!r}, got {got!r}")
    return message


def _take(message: dict, key: str, checking: bool):
    if checking and key not in message:
        raise ValueError(f"message {message['name']!r} lacks {key!r}")
    return message.pop(key, None)


def messages_to_state(get, md: argparse.Namespace, checking: bool = True) -> dict:
    """The full GPTModel state dict of the messages `get()` returns after the metadata, through "done"."""
    shape: GPTShape = md.shape
    message = _expect(get(), "embeddings", checking)
    state = {"embedding.word_embeddings.weight": _take(message, "word embeddings", checking)}
    if md.position_embedding_type == "learned_absolute":
        state["embedding.position_embeddings.weight"] = _take(message, "position embeddings", checking)
    for i in range(shape.num_layers):
        message = _expect(get(), f"transformer layer {i}", checking)
        prefix = f"decoder.layers.{i}."
        if shape.moe_layers and shape.moe_layers[i]:
            state.update(_moe_state(message, prefix, shape, checking))
        for key, suffix in _LAYER_KEYS.items():
            if shape.swiglu and key in _FC1_KEYS and f"{key} W" in message:
                state[prefix + suffix] = torch.cat([message.pop(f"{key} W"), message.pop(f"{key} V")], dim=0)
            elif key in message:
                state[prefix + suffix] = message.pop(key)
    message = _expect(get(), "final norm", checking)
    state["decoder.final_layernorm.weight"] = _take(message, "weight", checking)
    if md.norm_has_bias:
        state["decoder.final_layernorm.bias"] = _take(message, "bias", checking)
    if md.output_layer:
        state["output_layer.weight"] = _take(_expect(get(), "output layer", checking), "weight", checking)
    for depth in range(shape.mtp_num_layers or 0):
        message = _expect(get(), f"mtp layer {depth}", checking)
        state.update({f"mtp.layers.{depth}.{key}": tensor for key, tensor in message.items() if key != "name"})
    last = get()
    if last == "exit":
        raise RuntimeError("the loader failed (it sent 'exit'); see its error above")
    if checking and last != "done":
        raise ValueError("convert.py message order: expected 'done' after the last message")
    return state
