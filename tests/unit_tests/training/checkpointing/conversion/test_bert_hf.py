"""BERT export to Hugging Face: each transform on a hand-worked example, logits parity of BertModel with
`transformers` BertForPreTraining / MegatronBertForPreTraining loaded with the exported weights, and the
command line from a torch-format checkpoint to a directory that `from_pretrained` reads."""

import dataclasses
import json
import logging
import os

import pytest
import torch

from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.checkpointing.layout import TRACKER_FILENAME, get_checkpoint_name
from megatron.training.checkpointing.conversion.bert_hf import (
    bert_export_shape,
    bert_to_hf,
    hf_config,
    norm_names,
    split_qkv,
)
from megatron.training.checkpointing.conversion.export_bert_hf import main as export_main
from megatron.core.tokenizers.bert_wordpiece import BertWordPieceTokenizer

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, PADDED_VOCAB = 16, 100, 128
TINY_BERT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
             "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2", "--train-iters", "1",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4"]


def bert_args(*flags, exact_gelu: bool = True):
    """Validated arguments of a tiny BERT; `exact_gelu` turns off Megatron's default tanh-GELU fusion."""
    gelu = ["--no-bias-gelu-fusion"] if exact_gelu else []
    args = validate_args(parse_args(args_list=[*TINY_BERT, *gelu, *flags]))
    args.padded_vocab_size = PADDED_VOCAB
    return args


def trained_looking_bert(args) -> BertModel:
    """The model of `args` with every weight perturbed (norms and biases too), in eval mode."""
    torch.manual_seed(11)
    model = BertModel(
        core_transformer_config_from_args(args), 2 if args.bert_binary_head else 0, get_bert_layer_local_spec(),
        args.padded_vocab_size, args.max_position_embeddings, add_binary_head=args.bert_binary_head,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def hf_model(state: dict, config: dict):
    """The `transformers` model named by config["architectures"], with `state` loaded (only tied keys missing)."""
    hf_config_object = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    )
    model = getattr(transformers, config["architectures"][0])(hf_config_object).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    return model


def _inputs():
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=generator)
    padding_mask = torch.ones(3, SEQ, dtype=torch.long)
    padding_mask[1, 9:] = 0
    types = torch.zeros(3, SEQ, dtype=torch.long)
    types[:, 6:] = 1
    return ids, padding_mask, types


def test_split_qkv_unfuses_the_per_group_rows_and_repeats_shared_key_value_heads():
    # 4 query heads in 2 groups, head width 1, hidden 1: rows q0 q1 k0 v0 | q2 q3 k1 v1.
    fused = torch.tensor([[10.0], [11.0], [20.0], [30.0], [12.0], [13.0], [21.0], [31.0]])
    args = bert_args("--group-query-attention", "--num-query-groups", "2")
    shape = bert_export_shape(args, VOCAB)
    shape = dataclasses.replace(shape, hidden_size=4)  # head width 1
    query, key, value = split_qkv(fused, shape)
    assert query.flatten().tolist() == [10, 11, 12, 13]
    assert key.flatten().tolist() == [20, 20, 21, 21] and value.flatten().tolist() == [30, 30, 31, 31]
    q_bias, _, v_bias = split_qkv(fused.flatten(), shape)
    assert q_bias.tolist() == [10, 11, 12, 13] and v_bias.tolist() == [30, 30, 31, 31]


def test_norm_names_shift_by_one_place_for_the_post_norm_bert():
    shape = bert_export_shape(bert_args("--apply-residual-connection-post-layernorm"), VOCAB)
    assert norm_names(shape) == {
        "encoder.layers.0.input_layernorm": "bert.embeddings.LayerNorm",
        "encoder.layers.0.pre_mlp_layernorm": "bert.encoder.layer.0.attention.output.LayerNorm",
        "encoder.layers.1.input_layernorm": "bert.encoder.layer.0.output.LayerNorm",
        "encoder.layers.1.pre_mlp_layernorm": "bert.encoder.layer.1.attention.output.LayerNorm",
        "encoder.final_layernorm": "bert.encoder.layer.1.output.LayerNorm",
        "lm_head.layer_norm": "cls.predictions.transform.LayerNorm",
    }
    pre_norm = norm_names(bert_export_shape(bert_args(), VOCAB))
    assert pre_norm["encoder.layers.1.input_layernorm"] == "bert.encoder.layer.1.attention.ln"
    assert pre_norm["encoder.final_layernorm"] == "bert.encoder.ln"


PARITY_CASES = {
    "post-norm": (["--apply-residual-connection-post-layernorm"], "BertForPreTraining"),
    "pre-norm": ([], "MegatronBertForPreTraining"),
    "post-norm GQA, untied, layernorm-1p": (["--apply-residual-connection-post-layernorm", "--group-query-attention",
                                             "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
                                             "--apply-layernorm-1p"], "BertForPreTraining"),
    "no binary head, no biases": (["--apply-residual-connection-post-layernorm", "--bert-no-binary-head",
                                   "--disable-bias-linear"], "BertForMaskedLM"),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_logits_equal_transformers_with_the_exported_weights(case):
    flags, architecture = PARITY_CASES[case]
    args = bert_args(*flags)
    model = trained_looking_bert(args)
    shape = bert_export_shape(args, VOCAB)
    assert shape.architecture == architecture
    state = bert_to_hf(model.state_dict(), shape)
    assert state["bert.embeddings.word_embeddings.weight"].shape[0] == VOCAB  # the padding rows are gone
    assert state["cls.predictions.bias"].shape == (VOCAB,)
    reference = hf_model(state, hf_config(shape, 2, torch.float32, 0))
    ids, padding_mask, types = _inputs()
    if not args.bert_binary_head:
        types = None
    with torch.no_grad():
        logits, binary_logits = model(ids, padding_mask, tokentype_ids=types)
        output = reference(input_ids=ids, attention_mask=padding_mask, token_type_ids=types)
    hf_logits = output.prediction_logits if args.bert_binary_head else output.logits
    torch.testing.assert_close(logits[..., :VOCAB], hf_logits, atol=1e-5, rtol=1e-5)
    if args.bert_binary_head:
        torch.testing.assert_close(binary_logits, output.seq_relationship_logits, atol=1e-5, rtol=1e-5)


def test_tanh_gelu_is_exported_with_a_warning(caplog):
    args = bert_args("--apply-residual-connection-post-layernorm", exact_gelu=False)
    with caplog.at_level(logging.WARNING):
        shape = bert_export_shape(args, VOCAB)
    assert shape.hidden_act == "gelu_pytorch_tanh" and "--no-bias-gelu-fusion" in caplog.text
    model = trained_looking_bert(args)
    reference = hf_model(bert_to_hf(model.state_dict(), shape), hf_config(shape, 2, torch.float32, 0))
    ids, padding_mask, types = _inputs()
    with torch.no_grad():
        logits, _ = model(ids, padding_mask, tokentype_ids=types)
        hf_logits = reference(input_ids=ids, attention_mask=padding_mask, token_type_ids=types).prediction_logits
    # Only the LM head's GELU differs (exact here, tanh there).
    assert 0 < (logits[..., :VOCAB] - hf_logits).abs().max() < 1e-2


def test_settings_hugging_face_bert_cannot_express_are_refused_together():
    args = bert_args("--normalization", "RMSNorm", "--qk-layernorm", "--position-embedding-type", "rope")
    with pytest.raises(ValueError) as refusal:
        bert_export_shape(args, VOCAB)
    message = str(refusal.value)
    assert "--normalization RMSNorm" in message and "--qk-layernorm" in message and "rope" in message
    with pytest.raises(ValueError, match="--swiglu"):
        bert_export_shape(bert_args("--swiglu"), VOCAB)
    too_small = bert_export_shape(bert_args(), PADDED_VOCAB + 1)
    with pytest.raises(ValueError, match="fewer than the tokenizer's 129 ids"):
        bert_to_hf(trained_looking_bert(bert_args()).state_dict(), too_small)


WORDS = ["the", "quick", "brown", "fox", "jump", "##s", "over", "lazy", "dog", ".", "a", "b"]


def _save_checkpoint(directory, args, model) -> None:
    path = get_checkpoint_name(str(directory), 3, pipeline_parallel=False, tensor_rank=0, pipeline_rank=0,
                               expert_parallel=False, expert_rank=0)
    os.makedirs(os.path.dirname(path))
    torch.save({"args": args, "model": model.state_dict(), "iteration": 3, "checkpoint_version": 3.0}, path)
    (directory / TRACKER_FILENAME).write_text("3")


def test_command_line_writes_a_directory_transformers_loads(tmp_path):
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    args = bert_args("--apply-residual-connection-post-layernorm", "--tokenizer-type", "BertWordPieceLowerCase",
                     "--vocab-file", str(vocab_file))
    model = trained_looking_bert(args)
    _save_checkpoint(tmp_path / "ckpt", args, model)

    assert export_main(["--load", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf")]) == 0
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors",
                                                  "tokenizer_config.json", "vocab.txt"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    ours = BertWordPieceTokenizer(str(vocab_file), lower_case=True)
    assert config["vocab_size"] == ours.vocab_size == len(WORDS) + 7  # + Megatron's [BOS] and [EOS]
    reference, info = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    tokenizer = transformers.BertTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)

    ids = torch.tensor([[ours.cls, *ours.tokenize(text), ours.sep]])
    padding_mask, types = torch.ones_like(ids), torch.zeros_like(ids)
    with torch.no_grad():
        logits, binary_logits = model(ids, padding_mask, tokentype_ids=types)
        output = reference.eval()(input_ids=ids, attention_mask=padding_mask, token_type_ids=types)
    torch.testing.assert_close(logits[..., : ours.vocab_size], output.prediction_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(binary_logits, output.seq_relationship_logits, atol=1e-5, rtol=1e-5)


def test_command_line_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        export_main(["--load", str(tmp_path / "missing"), "--save-dir", str(tmp_path / "hf")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no torch-format checkpoint"):
        export_main(["--load", str(tmp_path / "empty"), "--save-dir", str(tmp_path / "hf")])
    args = bert_args()
    state = {"args": args, "model": {"embedding.word_embeddings.weight": torch.zeros(4, 4)}}
    path = get_checkpoint_name(str(tmp_path / "gpt"), 1, pipeline_parallel=False, tensor_rank=0, pipeline_rank=0,
                               expert_parallel=False, expert_rank=0)
    os.makedirs(os.path.dirname(path))
    torch.save(state, path)
    (tmp_path / "gpt" / TRACKER_FILENAME).write_text("1")
    with pytest.raises(ValueError, match="is not a BERT checkpoint"):
        export_main(["--load", str(tmp_path / "gpt"), "--save-dir", str(tmp_path / "hf")])
