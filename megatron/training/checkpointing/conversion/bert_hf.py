"""Megatron-Core `BertModel` state dict -> Hugging Face `transformers` BERT (state dict + config.json).

Which Hugging Face class computes the same function depends on where the norms sit:

    --apply-residual-connection-post-layernorm  (original, post-norm BERT)   -> BertForPreTraining
    default (Megatron's pre-norm BERT)                                       -> MegatronBertForPreTraining

(`...ForMaskedLM` instead when the model has no binary head, `--bert-no-binary-head`.) The layers of
`BertModel` are pre-norm; with the post-norm residual its norms line up with the original BERT's
shifted by one place (see `megatron/core/models/bert/bert_model.py`), which `norm_names` spells out.

One function per transform: `split_qkv` (per-group fused QKV -> query/key/value), `norm_names`
(LayerNorm names), `layer_to_hf`, `heads_to_hf` (pooler, cls.predictions, cls.seq_relationship),
`hf_config`; the padded vocabulary rows are dropped by `vocab_padding.trim_to_tokenizer`. `bert_to_hf`
applies them all to a full (TP=1) state dict; `tools/checkpoint/export_bert_hf.py` is the command line.
"""

import logging
from dataclasses import dataclass

import torch

from megatron.training.checkpointing.conversion.llama_hf import qkv_to_llama
from megatron.training.checkpointing.conversion.vocab_padding import trim_to_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BertExportShape:
    """What the export needs to know about the model, read from the training arguments."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int  # the tokenizer's, without the padding rows
    max_position_embeddings: int
    layernorm_epsilon: float
    post_layernorm: bool  # --apply-residual-connection-post-layernorm
    binary_head: bool
    tied_output: bool
    zero_centered_gamma: bool  # --apply-layernorm-1p: norm weights stored as w - 1
    hidden_act: str  # Hugging Face's name of the MLP activation
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02

    @property
    def kv_channels(self) -> int:
        """Head width hn (BERT's heads are hidden_size / num_attention_heads wide)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def architecture(self) -> str:
        prefix = "Bert" if self.post_layernorm else "MegatronBert"
        return prefix + ("ForPreTraining" if self.binary_head else "ForMaskedLM")


def _activation(args) -> str:
    """Hugging Face `hidden_act` of the MLP; refuses activations a BERT config cannot express."""
    for flag in ("swiglu", "squared_relu", "quick_geglu"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')}: Hugging Face BERT has a plain GELU MLP; this model "
                             "cannot be exported to it")
    # Megatron's fused bias-GELU kernel computes the tanh approximation (megatron/core/fusions/fused_bias_gelu.py).
    if getattr(args, "openai_gelu", False) or (getattr(args, "bias_gelu_fusion", False) and args.add_bias_linear):
        logger.warning(
            "the MLP uses the tanh approximation of GELU (--bias-gelu-fusion or --openai-gelu) but the LM head "
            "uses the exact GELU, while a Hugging Face BERT config has one hidden_act: exporting "
            "gelu_pytorch_tanh, so the masked-LM logits differ slightly (~1e-3); train with "
            "--no-bias-gelu-fusion for an exact export"
        )
        return "gelu_pytorch_tanh"
    return "gelu"


def bert_export_shape(args, vocab_size: int) -> BertExportShape:
    """The export shape of a BERT trained with `args` (the checkpoint's argparse Namespace); raises
    ValueError naming every setting Hugging Face BERT cannot represent."""
    problems = []
    if args.normalization != "LayerNorm":
        problems.append(f"--normalization {args.normalization}: Hugging Face BERT uses LayerNorm")
    if getattr(args, "qk_layernorm", False):
        problems.append("--qk-layernorm: Hugging Face BERT has no query/key norms")
    if args.position_embedding_type != "learned_absolute":
        problems.append(f"--position-embedding-type {args.position_embedding_type}: Hugging Face BERT uses "
                        "learned absolute positions")
    heads = args.num_attention_heads
    if args.kv_channels * heads != args.hidden_size:
        problems.append(f"--kv-channels {args.kv_channels} x {heads} heads != --hidden-size {args.hidden_size}: "
                        "Hugging Face BERT's heads are hidden_size / num_attention_heads wide")
    if problems:
        raise ValueError("this BERT cannot be exported to Hugging Face:\n  - " + "\n  - ".join(problems))
    return BertExportShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        layernorm_epsilon=args.layernorm_epsilon,
        post_layernorm=args.apply_residual_connection_post_layernorm,
        binary_head=args.bert_binary_head,
        tied_output=not args.untie_embeddings_and_output_weights,
        zero_centered_gamma=args.layernorm_zero_centered_gamma,
        hidden_act=_activation(args),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
    )


def split_qkv(fused: torch.Tensor, shape: BertExportShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_qkv` weight [ng*(np/ng+2)*hn, h] (or bias) -> query, key, value [np*hn, ...] each.

    The per-group rows [ng, np/ng + 2, hn, ...] (each group's np/ng query heads, its key head, its value
    head) are split as for Llama (`llama_hf.qkv_to_llama`). Hugging Face BERT has one key/value head per
    query head, so with grouped-query attention each group's key and value are repeated for its np/ng
    query heads: the same function, as query head j uses group j // (np/ng).
    """
    query, key, value = qkv_to_llama(fused, shape)
    per_group = shape.num_attention_heads // shape.num_query_groups
    repeat = [head.reshape(shape.num_query_groups, shape.kv_channels, *fused.shape[1:])
              .repeat_interleave(per_group, dim=0).reshape(query.shape) for head in (key, value)]
    return query, *repeat


def norm_names(shape: BertExportShape) -> dict:
    """{Megatron norm prefix: Hugging Face norm prefix} for every LayerNorm of the encoder.

    Pre-norm (MegatronBert): input_layernorm -> attention.ln, pre_mlp_layernorm -> ln, final -> encoder.ln.
    Post-norm (Bert): layer 0's input_layernorm is the embedding norm, layer i's pre_mlp_layernorm the
    attention output norm, and the norm after layer i (layer i+1's input_layernorm, or the final norm)
    its output norm.
    """
    names = {}
    for i in range(shape.num_layers):
        megatron, hf = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        if shape.post_layernorm:
            names[megatron + "input_layernorm"] = (
                "bert.embeddings.LayerNorm" if i == 0 else f"bert.encoder.layer.{i - 1}.output.LayerNorm"
            )
            names[megatron + "pre_mlp_layernorm"] = hf + "attention.output.LayerNorm"
        else:
            names[megatron + "input_layernorm"] = hf + "attention.ln"
            names[megatron + "pre_mlp_layernorm"] = hf + "ln"
    last = shape.num_layers - 1
    names["encoder.final_layernorm"] = (
        f"bert.encoder.layer.{last}.output.LayerNorm" if shape.post_layernorm else "bert.encoder.ln"
    )
    names["lm_head.layer_norm"] = "cls.predictions.transform.LayerNorm"
    return names


def _vocab_rows(state: dict, name: str, shape: BertExportShape) -> torch.Tensor:
    """The tokenizer's rows of a vocabulary tensor: the rows added by --make-vocab-size-divisible-by go."""
    return trim_to_tokenizer(state[name], shape.vocab_size, name)


def _norm(state: dict, prefix: str, shape: BertExportShape) -> tuple[torch.Tensor, torch.Tensor]:
    weight = state[prefix + ".weight"]
    return (weight + 1 if shape.zero_centered_gamma else weight), state[prefix + ".bias"]


def _bias(state: dict, key: str, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The bias, or zeros when the model has none (--disable-bias-linear): the same function."""
    return state[key] if key in state else torch.zeros(rows, dtype=like.dtype)


def layer_to_hf(state: dict, i: int, shape: BertExportShape) -> dict:
    """Attention and MLP linears of encoder layer i (the norms are mapped by `norm_names`)."""
    megatron, hf = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
    qkv_weight = state[megatron + "self_attention.linear_qkv.weight"]
    qkv_rows = qkv_weight.shape[0]
    qkv_bias = _bias(state, megatron + "self_attention.linear_qkv.bias", qkv_rows, qkv_weight)
    out = {}
    for name, weight, bias in zip(("query", "key", "value"), split_qkv(qkv_weight, shape), split_qkv(qkv_bias, shape)):
        out[hf + f"attention.self.{name}.weight"] = weight
        out[hf + f"attention.self.{name}.bias"] = bias
    linears = (
        ("self_attention.linear_proj", "attention.output.dense"),
        ("mlp.linear_fc1", "intermediate.dense"),
        ("mlp.linear_fc2", "output.dense"),
    )
    for megatron_name, hf_name in linears:
        weight = state[megatron + megatron_name + ".weight"]
        out[hf + hf_name + ".weight"] = weight
        out[hf + hf_name + ".bias"] = _bias(state, megatron + megatron_name + ".bias", weight.shape[0], weight)
    return out


def heads_to_hf(state: dict, shape: BertExportShape) -> dict:
    """Pooler, masked-LM head (transform, output bias, untied decoder) and sentence-order head."""
    out = {
        "cls.predictions.transform.dense.weight": state["lm_head.dense.weight"],
        "cls.predictions.transform.dense.bias": state["lm_head.dense.bias"],
        "cls.predictions.bias": _vocab_rows(state, "output_layer.bias", shape),
    }
    if not shape.tied_output:
        out["cls.predictions.decoder.weight"] = _vocab_rows(state, "output_layer.weight", shape)
    if shape.binary_head:
        out["bert.pooler.dense.weight"] = state["pooler.dense.weight"]
        out["bert.pooler.dense.bias"] = state["pooler.dense.bias"]
        out["cls.seq_relationship.weight"] = state["binary_head.weight"]
        out["cls.seq_relationship.bias"] = state["binary_head.bias"]
    return out


def _embeddings_to_hf(state: dict, shape: BertExportShape) -> dict:
    word = _vocab_rows(state, "embedding.word_embeddings.weight", shape)
    # Without the binary head Megatron trains no token types; zero rows keep HF's token_type_ids a no-op.
    token_types = state.get("embedding.tokentype_embeddings.weight")
    if token_types is None:
        token_types = torch.zeros(2, shape.hidden_size, dtype=word.dtype)
    return {
        "bert.embeddings.word_embeddings.weight": word,
        "bert.embeddings.position_embeddings.weight": state["embedding.position_embeddings.weight"],
        "bert.embeddings.token_type_embeddings.weight": token_types,
    }


def bert_to_hf(state: dict, shape: BertExportShape) -> dict:
    """The Hugging Face state dict of `shape.architecture` from a full (TP=1) BertModel state dict."""
    out = _embeddings_to_hf(state, shape)
    for i in range(shape.num_layers):
        out.update(layer_to_hf(state, i, shape))
    for megatron, hf in norm_names(shape).items():
        out[hf + ".weight"], out[hf + ".bias"] = _norm(state, megatron, shape)
    out.update(heads_to_hf(state, shape))
    # safetensors stores each tensor on its own: no views into the (larger, padded) originals.
    return {key: value.detach().clone().contiguous() for key, value in out.items()}


def hf_config(shape: BertExportShape, token_type_rows: int, torch_dtype: torch.dtype, pad_token_id: int) -> dict:
    """config.json for `shape.architecture` (model_type "bert" or "megatron-bert")."""
    return {
        "architectures": [shape.architecture],
        "model_type": "bert" if shape.post_layernorm else "megatron-bert",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "intermediate_size": shape.ffn_hidden_size,
        "hidden_act": shape.hidden_act,
        "max_position_embeddings": shape.max_position_embeddings,
        "type_vocab_size": token_type_rows,
        "layer_norm_eps": shape.layernorm_epsilon,
        "hidden_dropout_prob": shape.hidden_dropout,
        "attention_probs_dropout_prob": shape.attention_dropout,
        "initializer_range": shape.init_method_std,
        "tie_word_embeddings": shape.tied_output,
        "pad_token_id": pad_token_id,
        "position_embedding_type": "absolute",
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
    }
