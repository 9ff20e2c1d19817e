"""Export to Hugging Face with tools/checkpoint/convert.py, load with `transformers` from_pretrained, and import
back: GPT-2-shaped (LayerNorm, learned positions, MHA, biases, tied) and Llama-shaped (GQA, RoPE, SwiGLU,
RMSNorm, untied, no biases) models.

Tolerance: fp32 logits within atol 1e-4 of ours (the models differ only in summation order; observed
~1e-6 at |logits| ~ 10); a wrong GELU variant or a mis-ordered QKV moves them by > 1e-2.
"""

import json
import os

import pytest
import torch

from megatron.core.inference.generation import generate_tokens
from megatron.training.checkpoint_conversion.convert import main as convert
from megatron.training.checkpoint_conversion.torch_checkpoint import read_torch_checkpoint
from tests.unit_tests.training.checkpoint_conversion.gpt_models import (
    PADDED_VOCAB,
    TRUE_VOCAB,
    build_model,
    logits,
    model_args,
    save_model,
)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 8


def _export(tmp_path, name, *flags):
    args = model_args(name, *flags)
    model = build_model(args)
    save_model(model, args, str(tmp_path / "megatron"))
    convert(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
             "--save-dir", str(tmp_path / "hf"), "--true-vocab-size", str(TRUE_VOCAB)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    return model, hf


@pytest.mark.parametrize("name, flags, architecture", [
    ("gpt2", ["--no-bias-gelu-fusion"], "GPT2LMHeadModel"),
    ("gpt2", [], "GPT2LMHeadModel"),  # fused bias-GELU = the tanh approximation = HF gelu_new
    ("llama", [], "LlamaForCausalLM"),
    ("llama", ["--add-qkv-bias"], "Qwen2ForCausalLM"),
])
def test_export_logits_and_greedy_generation_match_transformers(tmp_path, name, flags, architecture):
    model, hf = _export(tmp_path, name, *flags)
    assert type(hf).__name__ == architecture
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == TRUE_VOCAB and config["architectures"] == [architecture]
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] == (name == "gpt2")
    tokens = torch.randint(0, TRUE_VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    ours = logits(model, tokens)
    assert ours.shape[-1] == PADDED_VOCAB
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours[..., :TRUE_VOCAB], theirs, atol=ATOL, rtol=0)

    hf.generation_config.eos_token_id = None
    prompt = tokens[0, :6].tolist()
    expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert generate_tokens(model, [prompt], NEW_TOKENS, vocab_size=TRUE_VOCAB) == [expected]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_import_back_gives_bitwise_identical_weights(tmp_path, name):
    model, _ = _export(tmp_path, name)
    convert(["--model-type", "GPT", "--loader", "hf", "--saver", "core", "--load-dir", str(tmp_path / "hf"),
             "--save-dir", str(tmp_path / "back")])
    state, args, iteration, release = read_torch_checkpoint(str(tmp_path / "back"))
    original = model.state_dict()
    assert set(state) == {key for key in original if not key.endswith("_extra_state")}
    assert release and args.padded_vocab_size == PADDED_VOCAB  # re-padded: 100 rows up to a multiple of 64
    for key, tensor in state.items():
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(tensor[:TRUE_VOCAB], original[key][:TRUE_VOCAB]), key
            # Padding rows repeat the last real row (Megatron's savers do the same).
            assert torch.equal(tensor[TRUE_VOCAB:], original[key][TRUE_VOCAB - 1].expand(PADDED_VOCAB - TRUE_VOCAB, -1))
        else:
            assert torch.equal(tensor, original[key]), key


def test_sharded_safetensors_with_index(tmp_path):
    args = model_args("llama")
    save_model(build_model(args), args, str(tmp_path / "megatron"))
    convert(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
             "--save-dir", str(tmp_path / "hf"), "--true-vocab-size", str(TRUE_VOCAB), "--max-shard-size", "40000"])
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.isfile(tmp_path / "hf" / name) for name in files)
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert hf.model.layers[3].mlp.gate_proj.weight.shape == (96, 64)


def _byte_level_bpe(directory) -> tuple[str, str]:
    """vocab.json + merges.txt of a byte-level BPE of about 300 tokens with `<|endoftext|>`, trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30], trainer)
    tokenizer.model.save(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def test_gpt2_tokenizer_files_are_copied_and_vocab_size_is_the_tokenizers(tmp_path):
    from megatron.training.tokenizer import GPT2BPETokenizer

    (tmp_path / "tokenizer").mkdir()
    vocab_file, merge_file = _byte_level_bpe(tmp_path / "tokenizer")
    ours = GPT2BPETokenizer(vocab_file, merge_file)
    args = model_args("gpt2", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                      "--merge-file", merge_file)
    args.padded_vocab_size = 320  # ~300 ids up to a multiple of 64
    save_model(build_model(args), args, str(tmp_path / "megatron"))
    convert(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
             "--save-dir", str(tmp_path / "hf")])  # no --true-vocab-size: the tokenizer is built and asked
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == ours.vocab_size and 256 < ours.vocab_size <= 300
    assert config["eos_token_id"] == ours.eod and json.loads(
        (tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == ours.eod
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "the lazy fox says hello world"
    assert theirs(text)["input_ids"] == ours.tokenize(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert hf.transformer.wte.weight.shape[0] == ours.vocab_size
