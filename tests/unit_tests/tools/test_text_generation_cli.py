"""tools/text_generation_cli.py end to end on a checkpoint that pretrain_gpt.py writes here (2 iterations,
mock data, a Llama-shaped GPT with RoPE, GQA, SwiGLU, RMSNorm, and a byte-level GPT-2 BPE tokenizer).

The reference is independent of the loader: a GPTModel built from a TransformerConfig written out below,
loaded from the checkpoint file with torch.load, decoded greedily by full recomputation, and the text
decoded by `transformers`' GPT2Tokenizer from the same files.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import global_vars
from megatron.core.tokenizers.gpt2_bpe import bytes_to_unicode

from .tool_loader import load_tool

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
EOD = 256  # "<|endoftext|>" after the 256 byte tokens
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "32", "--max-position-embeddings", "48",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, vocab.json, merges.txt) after 2 training iterations, saved at iterations 1 and 2."""
    directory = tmp_path_factory.mktemp("generation")
    vocab_file, merge_file = str(directory / "vocab.json"), str(directory / "merges.txt")
    vocab = {character: index for index, character in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = EOD
    with open(vocab_file, "w") as file:
        json.dump(vocab, file)
    with open(merge_file, "w") as file:
        file.write("#version: 0.2\n")
    save = str(directory / "checkpoints")
    command = [
        sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL_FLAGS, "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-2", "--train-iters", "2", "--mock-data",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file,
        "--save", save, "--save-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--ckpt-format", "torch",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return save, vocab_file, merge_file


@pytest.fixture(autouse=True)
def _forget_globals():
    yield
    global_vars.unset_global_variables()  # the CLI sets the run-wide args and tokenizer, as a run does


def _run(argv, stdin=None):
    """(exit status, stdout, stderr) of the CLI's main, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = load_tool("text_generation_cli").main(argv, stdin=stdin)
    return status, out.getvalue(), err.getvalue()


def _reference_model(checkpoint_file):
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=384, max_sequence_length=48,
                     position_embedding_type="rope").eval()  # 257 ids padded to a multiple of 128
    model.load_state_dict(torch.load(checkpoint_file, weights_only=False)["model"], strict=True)
    return model


def _reference_text(trained, prompt, new_tokens, iteration=2):
    """Greedy continuation by full recomputation, stopping at end-of-document, decoded by transformers."""
    save, vocab_file, merge_file = trained
    model = _reference_model(os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt"))
    hf_tokenizer = transformers.GPT2Tokenizer(vocab_file, merge_file)
    sequence = hf_tokenizer.encode(prompt)
    prompt_length = len(sequence)
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], None)
        token = int(logits[0, -1, :EOD + 1].argmax())
        if token == EOD:
            break
        sequence.append(token)
    assert len(sequence) > prompt_length
    return hf_tokenizer.decode(sequence)


def test_greedy_generation_matches_the_reference(trained):
    save = trained[0]
    status, out, err = _run(["--load", save, "--prompt", "def main(", "--max-new-tokens", "8", "--greedy"])
    assert status == 0, err
    assert out == _reference_text(trained, "def main(", 8) + "\n"
    assert "iter_0000002" in err and "building GPT model" in err  # loading notes stay off stdout


def test_ckpt_step_and_megatron_flag_spellings(trained):
    save = trained[0]
    status, out, err = _run(["--load", save, "--ckpt-step", "1", "--prompt", "x = ", "--out-seq-length", "6",
                             "--top_k", "1", "--device", "cpu"])
    assert status == 0, err
    assert "iter_0000001" in err
    assert out == _reference_text(trained, "x = ", 6, iteration=1) + "\n"


def test_sampling_is_seeded(trained):
    argv = ["--load", trained[0], "--prompt", "a", "--prompt", "bc", "--max-new-tokens", "10",
            "--temperature", "1.3", "--top-p", "0.95", "--top-k", "50"]
    first, second, other = _run(argv + ["--seed", "3"]), _run(argv + ["--seed", "3"]), _run(argv + ["--seed", "4"])
    assert first[0] == 0 and first[1] == second[1] != other[1]
    assert first[1].startswith("a")


def test_prompts_from_stdin_one_per_line(trained):
    save = trained[0]
    stdin = io.StringIO("import os\n\nclass A:\n")
    status, out, err = _run(["--load", save, "--greedy", "--max-new-tokens", "5"], stdin=stdin)
    assert status == 0, err
    assert out == _reference_text(trained, "import os", 5) + "\n" + _reference_text(trained, "class A:", 5) + "\n"


def test_a_prompt_too_long_in_stdin_mode_is_reported_and_the_session_goes_on(trained):
    stdin = io.StringIO("y" * 45 + "\nok\n")
    status, out, err = _run(["--load", trained[0], "--greedy", "--max-new-tokens", "5"], stdin=stdin)
    assert status == 0
    assert "the longest prompt (45 tokens) plus 5 new tokens exceeds the model's max_sequence_length of 48" in err
    assert out == _reference_text(trained, "ok", 5) + "\n"


def test_moved_tokenizer_files_are_named_and_can_be_overridden(trained, tmp_path):
    save, vocab_file, merge_file = trained
    checkpoint = str(tmp_path / "moved")
    shutil.copytree(save, checkpoint)
    iteration = os.path.join(checkpoint, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(iteration, weights_only=False)
    state["args"].vocab_file = str(tmp_path / "gone" / "vocab.json")
    state["args"].merge_file = str(tmp_path / "gone" / "merges.txt")
    torch.save(state, iteration)

    status, _, err = _run(["--load", checkpoint, "--prompt", "hi"])
    assert status == 1
    assert "--vocab-file" in err and str(tmp_path / "gone" / "vocab.json") in err and "does not exist" in err
    assert "if its files moved, give their new paths with --vocab-file, --merge-file" in err

    status, out, err = _run(["--load", checkpoint, "--prompt", "hi", "--greedy", "--max-new-tokens", "4",
                             "--vocab-file", vocab_file, "--merge-file", merge_file])
    assert status == 0, err
    assert out == _reference_text(trained, "hi", 4) + "\n"


def test_tensor_parallel_checkpoints_are_refused(trained, tmp_path):
    checkpoint = str(tmp_path / "tp2")
    shutil.copytree(trained[0], checkpoint)
    iteration = os.path.join(checkpoint, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(iteration, weights_only=False)
    state["args"].tensor_model_parallel_size = 2
    torch.save(state, iteration)
    status, _, err = _run(["--load", checkpoint, "--prompt", "hi"])
    assert status == 1
    assert "tensor_model_parallel_size=2" in err and "TP=1 only for now" in err


def test_missing_checkpoints_are_explained(tmp_path):
    status, _, err = _run(["--load", str(tmp_path / "nowhere"), "--prompt", "hi"])
    assert status == 1 and f"--load {tmp_path / 'nowhere'}: no such directory" in err

    (tmp_path / "iter_0000007").mkdir()
    status, _, err = _run(["--load", str(tmp_path), "--prompt", "hi"])
    assert status == 1
    assert "holds no checkpoint" in err and "latest_checkpointed_iteration.txt does not exist" in err
    assert "it has iter_0000007: pick one with --ckpt-step N" in err

    status, _, err = _run(["--load", str(tmp_path), "--prompt", "hi", "--ckpt-step", "3"])
    assert status == 1 and "--ckpt-step 3" in err and "has no iter_0000003" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "0"], "temperature must be a positive number"),
        (["--top-p", "1.5"], "top_p must be in [0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--device", "warp9"], "--device 'warp9' is not a device torch knows"),
    ],
)
def test_bad_flags_are_named(trained, flags, message):
    status, _, err = _run(["--load", trained[0], "--prompt", "hi", *flags])
    assert status == 1 and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused(trained):
    status, _, err = _run(["--load", trained[0], "--prompt", "hi", "--device", "cuda"])
    assert status == 1 and "no CUDA device is available here; use --device cpu" in err


def test_the_script_runs_as_a_command(trained):
    save = trained[0]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "text_generation_cli.py"), "--load", save, "--prompt", "def",
         "--greedy", "--max-new-tokens", "5", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == _reference_text(trained, "def", 5) + "\n"
