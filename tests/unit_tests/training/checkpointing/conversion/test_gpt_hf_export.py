"""Export to Hugging Face with tools/checkpoint/convert.py, load with `transformers` from_pretrained, and import
back: GPT-2-shaped (LayerNorm, learned positions, MHA, biases, tied), Llama-shaped (GQA, RoPE, SwiGLU,
RMSNorm, untied, no biases), Qwen2-shaped (Llama with q/k/v biases), Mixtral-shaped (Llama's attention,
4 SwiGLU experts in every layer, top-2 routing), Qwen3-MoE-shaped (GQA with q/k norms and its own head
width, a dense layer, then experts) and DeepSeek-V3-shaped models (multi-latent attention with YaRN, a dense
layer, then group-limited sigmoid routing with expert bias, scaling factor and a shared expert; and MLA
without query latent, plain RoPE, dense); a Mistral model made by `transformers` imports. The export runs on
a CPU without importing model code.

Tolerance: fp32 logits within atol 1e-4 of ours (the models differ only in summation order; observed
~1e-6 at |logits| ~ 10, Mixtral ~5e-6 at |logits| ~ 7); a wrong GELU variant, a mis-ordered QKV,
swapped expert w1/w3, MLA's rotary channels not de-interleaved or a missing routing scaling factor move them
by > 1e-2.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.inference.generation import generate_tokens
from megatron.training.checkpointing.conversion.convert import main as convert
from megatron.training.checkpointing.conversion.deepseek_v3_hf import deepseek_v3_config, deepseek_v3_export_problems
from megatron.training.checkpointing.conversion.gpt_shape import gpt_shape_from_args
from megatron.training.checkpointing.conversion.torch_checkpoint import read_torch_checkpoint
from tests.unit_tests.training.checkpointing.conftest import single_rank  # noqa: F401 (the fixture)
from tests.unit_tests.training.checkpointing.conversion.gpt_models import (
    PADDED_VOCAB,
    TRUE_VOCAB,
    build_model,
    gpt_model,
    logits,
    model_args,
    save_model,
)

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 8
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", ".."))
# MoE layers build their expert-parallel groups: the Mixtral-shaped tests run on one initialised rank.
pytestmark = pytest.mark.usefixtures("single_rank")


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
    ("mixtral", [], "MixtralForCausalLM"),
    ("qwen3_moe", [], "Qwen3MoeForCausalLM"),
    ("qwen3_moe", ["--moe-router-pre-softmax"], "Qwen3MoeForCausalLM"),  # norm_topk_prob false
    ("deepseek_v3", ["--mtp-num-layers", "1"], "DeepseekV3ForCausalLM"),  # the MTP layer as DeepSeek's layer L
    ("deepseek_v3_dense", [], "DeepseekV3ForCausalLM"),
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


@pytest.mark.parametrize("name, flags", [("gpt2", []), ("llama", []), ("llama", ["--add-qkv-bias"]), ("mixtral", []),
                                         ("qwen3_moe", []), ("deepseek_v3", ["--mtp-num-layers", "1"])])
def test_import_back_gives_bitwise_identical_weights(tmp_path, name, flags):
    model, _ = _export(tmp_path, name, *flags)
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
    from megatron.core.tokenizers import GPT2BPETokenizer

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


@pytest.mark.parametrize("flags, message", [
    (["--moe-layer-freq", "2"], "--moe-layer-freq with dense layers (Mixtral has experts in every layer)"),
    (["--moe-router-pre-softmax"], "--moe-router-pre-softmax (Mixtral renormalises the top-k weights)"),
    (["--moe-shared-expert-intermediate-size", "64"], "--moe-shared-expert-intermediate-size (Mixtral has no shared "
                                                      "experts)"),
])
def test_moe_models_mixtral_cannot_express_are_refused_by_name(tmp_path, flags, message):
    args = model_args("mixtral", *flags)
    save_model(build_model(args), args, str(tmp_path / "megatron"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
                 "--save-dir", str(tmp_path / "hf"), "--true-vocab-size", str(TRUE_VOCAB)])
    assert not os.path.exists(tmp_path / "hf" / "config.json")


def test_deepseek_v3_config_holds_the_routing_and_what_it_cannot_express_is_refused():
    shape = gpt_shape_from_args(model_args("deepseek_v3"), TRUE_VOCAB)
    config = deepseek_v3_config(shape, None, None)
    routing = ("first_k_dense_replace", "n_group", "topk_group", "n_shared_experts", "routed_scaling_factor",
               "norm_topk_prob")
    assert [config[key] for key in routing] == [1, 4, 2, 1, 2.5, True]
    assert config["rope_scaling"]["factor"] == 4 and "attention_factor" not in config["rope_scaling"]
    refused = deepseek_v3_export_problems(gpt_shape_from_args(model_args("deepseek_v3", "--moe-router-topk", "6"),
                                                              TRUE_VOCAB))
    assert any("the top-k must be twice the group top-k" in problem for problem in refused)
    assert deepseek_v3_export_problems(gpt_shape_from_args(model_args("llama"), TRUE_VOCAB))[0].startswith(
        "no --multi-latent-attention")


def _mistral(directory) -> "transformers.MistralForCausalLM":
    """A Mistral model made and saved by `transformers` (GQA, untied; sliding_window None: full attention)."""
    torch.manual_seed(5)
    config = transformers.MistralConfig(
        vocab_size=TRUE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False, initializer_range=0.1,
    )
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def test_mistral_from_transformers_imports_and_exports_back_bitwise(tmp_path):
    mistral = _mistral(tmp_path / "mistral")
    convert(["--model-type", "GPT", "--loader", "hf", "--saver", "core", "--load-dir", str(tmp_path / "mistral"),
             "--save-dir", str(tmp_path / "megatron")])
    state, args, _, _ = read_torch_checkpoint(str(tmp_path / "megatron"))
    # 100 ids padded to a multiple of --make-vocab-size-divisible-by 128
    assert (args.num_query_groups, args.rotary_base, args.padded_vocab_size) == (2, 1e6, 128)
    model = gpt_model(args).eval()
    model.load_state_dict(state, strict=False)  # strict but for the _extra_state entries
    assert set(state) == {key for key in model.state_dict() if not key.endswith("_extra_state")}
    tokens = torch.randint(0, TRUE_VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = mistral(tokens).logits
    torch.testing.assert_close(logits(model, tokens)[..., :TRUE_VOCAB], theirs, atol=ATOL, rtol=0)

    convert(["--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
             "--save-dir", str(tmp_path / "back"), "--true-vocab-size", str(TRUE_VOCAB)])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    original = mistral.state_dict()
    assert back.state_dict().keys() == original.keys()
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[key]), key


def test_export_needs_no_gpu_and_imports_no_model_code(tmp_path):
    args = model_args("llama")
    save_model(build_model(args), args, str(tmp_path / "megatron"))
    argv = ["convert.py", "--model-type", "GPT", "--loader", "core", "--saver", "hf", "--load-dir",
            str(tmp_path / "megatron"), "--save-dir", str(tmp_path / "hf"), "--true-vocab-size", str(TRUE_VOCAB)]
    script = (
        "import json, runpy, sys, torch\n"
        f"sys.argv = {argv!r}\n"
        "try:\n"
        f"    runpy.run_path({os.path.join(ROOT, 'tools', 'checkpoint', 'convert.py')!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'cuda': torch.cuda.is_initialized()}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    model_code = ("megatron.core.models", "megatron.core.transformer", "megatron.core.tensor_parallel",
                  "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.fusions",
                  "megatron.core.inference", "transformers", "triton", "transformer_engine", "apex")
    assert [name for name in report["modules"] if name.startswith(model_code)] == []
    assert not report["cuda"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
