"""Every example runs as a user starts it (examples must not rot).

The shell scripts run under torchrun on the CPU with mock data and tiny overrides for 2 iterations; the
175B script, which needs TP 8 x PP 16, goes through the real argument parser with a faked world of 128
ranks; `examples/gpt3/config.yaml` runs through pretrain_gpt.py; the simple Megatron-Core loop runs under
torchrun at TP=2 and as one process at TP=1, which is its reference. What a script hands to torchrun is
read with a stand-in `torchrun` on PATH and checked against the GPT-3 paper (Brown et al. 2020).
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from megatron.training.arguments import parse_args, validate_args

from .harness import ROOT, free_port, read_scalars

PRETRAIN_GPT = os.path.join(ROOT, "pretrain_gpt.py")
GPT3_SIZE_SCRIPTS = ["train_gpt3_125m.sh", "train_gpt3_350m.sh", "train_gpt3_1.3b.sh"]
SCRIPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}  # pretrain_gpt.py's args_defaults

# Appended after a script's positional arguments; argparse keeps the last occurrence of a flag.
TINY_OVERRIDES = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-samples", "8",
    "--vocab-size", "512", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "1",
]
TINY_LLAMA_OVERRIDES = TINY_OVERRIDES + [
    "--ffn-hidden-size", "128", "--num-query-groups", "2", "--kv-channels", "16",
    "--lr-warmup-samples", "0", "--lr-decay-samples", "8",
]


def _environment(**overrides) -> dict:
    """CPU only, one thread per rank, this interpreter's torchrun first on PATH, the repository importable."""
    python_bin = os.path.dirname(sys.executable)
    environment = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        GPUS_PER_NODE="1",
        MASTER_PORT=free_port(),
        PATH=f"{python_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    environment.update(overrides)
    return environment


def _run(command: list[str], cwd, **environment) -> str:
    """Runs `command`; returns its stdout + stderr, or fails the test with their tails."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                            env=_environment(**environment))
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited with {result.returncode}\n{output[-6000:]}")
    return output


def _assert_trained_two_iterations(output: str, run_dir) -> None:
    assert re.search(r"iteration\s+2/\s+2 \|", output), output[-4000:]
    losses = [float(value) for value in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", output)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    # The final checkpoint went to CHECKPOINT_PATH and the losses to TENSORBOARD_LOGS_PATH.
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(read_scalars(str(run_dir / "tb"), "lm loss")) == [1, 2]


def _captured_launch(script: str, arguments: list[str], tmp_path, **environment) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, pretrain_gpt.py's arguments) as `script` passes them, read by a stand-in
    `torchrun` that records its command line instead of training."""
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir(exist_ok=True)
    fake_torchrun = bin_dir / "torchrun"
    fake_torchrun.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$TORCHRUN_COMMAND_LINE"\n')
    fake_torchrun.chmod(0o755)
    record = tmp_path / "torchrun_command_line"
    subprocess.run(
        ["bash", os.path.join(ROOT, script), *arguments], cwd=tmp_path, check=True, capture_output=True,
        env=_environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TORCHRUN_COMMAND_LINE=str(record),
                         **environment),
    )
    words = record.read_text().splitlines()
    split = words.index(PRETRAIN_GPT)
    return words[:split], words[split + 1:]


def _parsed(pretrain_arguments: list[str], monkeypatch, world_size: int):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return parse_args(args_list=pretrain_arguments)


@pytest.mark.parametrize("script", GPT3_SIZE_SCRIPTS)
def test_gpt3_script_trains_two_iterations_on_cpu(script, tmp_path):
    output = _run(["bash", os.path.join(ROOT, "examples", "gpt3", script), "ckpt", "tb", "MOCK", "MOCK", "MOCK",
                   *TINY_OVERRIDES], cwd=tmp_path)
    _assert_trained_two_iterations(output, tmp_path)


def test_llama3_8b_script_trains_two_iterations_on_cpu(tmp_path):
    output = _run(["bash", os.path.join(ROOT, "examples", "llama", "train_llama3_8b.sh"), "ckpt", "tb", "MOCK",
                   "MOCK", *TINY_LLAMA_OVERRIDES], cwd=tmp_path)
    _assert_trained_two_iterations(output, tmp_path)


# examples/llama/train_llama3_8b_h100_fp8.sh's FP8 and communication flags, which the script leaves out.
MEGATRON_LLAMA3_FP8_FLAGS = [
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
]


def test_llama3_8b_script_trains_with_megatrons_fp8_flags_on_two_ranks(tmp_path):
    """FP8 GEMMs with the weights stored in FP8 and all-gathered as bytes, at DP=2 (torch._scaled_mm on CPU)."""
    output = _run(["bash", os.path.join(ROOT, "examples", "llama", "train_llama3_8b.sh"), "ckpt", "tb", "MOCK",
                   "MOCK", *TINY_LLAMA_OVERRIDES, *MEGATRON_LLAMA3_FP8_FLAGS], cwd=tmp_path, GPUS_PER_NODE="2")
    _assert_trained_two_iterations(output, tmp_path)


def test_config_yaml_trains_two_iterations_with_command_line_overrides(tmp_path):
    output = _run([sys.executable, PRETRAIN_GPT, "--config-file", os.path.join(ROOT, "examples", "gpt3", "config.yaml"),
                   *TINY_OVERRIDES, "--save", "ckpt", "--save-interval", "100", "--tensorboard-dir", "tb"],
                  cwd=tmp_path)
    _assert_trained_two_iterations(output, tmp_path)


# Brown et al. 2020, table 2.1: layers, d_model, heads, batch (sequences of 2048), learning rate. XL's
# "24 heads of 128" cannot split d_model 2048; the script uses 16 heads of 128.
GPT3_PAPER_SIZES = {
    "train_gpt3_125m.sh": (12, 768, 12, 256, 6.0e-4),
    "train_gpt3_350m.sh": (24, 1024, 16, 256, 3.0e-4),
    "train_gpt3_1.3b.sh": (24, 2048, 16, 512, 2.0e-4),
}


@pytest.mark.parametrize("script", GPT3_SIZE_SCRIPTS)
def test_gpt3_script_is_the_papers_recipe_and_valid_on_8_gpus(script, tmp_path, monkeypatch):
    torchrun_arguments, pretrain_arguments = _captured_launch(
        f"examples/gpt3/{script}", ["ckpt", "tb", "MOCK", "MOCK", "MOCK"], tmp_path, GPUS_PER_NODE="8")
    assert torchrun_arguments[:2] == ["--nproc_per_node", "8"]
    args = validate_args(_parsed(pretrain_arguments, monkeypatch, world_size=8), SCRIPT_DEFAULTS)
    layers, hidden, heads, batch, lr = GPT3_PAPER_SIZES[script]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (layers, hidden, heads)
    assert (args.seq_length, args.global_batch_size, args.lr, args.min_lr) == (2048, batch, lr, pytest.approx(lr / 10))
    # 300B tokens, warmup over 375M, cosine decay over 260B (appendix B).
    assert args.train_samples * 2048 == 300_000_000_000
    assert args.lr_warmup_samples * 2048 == pytest.approx(375e6, rel=1e-4)
    assert args.lr_decay_samples * 2048 == 260_000_000_000
    assert args.lr_decay_style == "cosine"
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps, args.weight_decay, args.clip_grad) == (
        0.9, 0.95, 1e-8, 0.1, 1.0)
    assert args.bf16 and args.mock_data and args.tokenizer_type == "NullTokenizer" and args.vocab_size == 50257
    assert (args.save, args.load, args.tensorboard_dir, args.split) == ("ckpt", "ckpt", "tb", "949,50,1")


def test_gpt3_125m_script_and_config_yaml_describe_the_same_run(tmp_path, monkeypatch):
    _, pretrain_arguments = _captured_launch(
        "examples/gpt3/train_gpt3_125m.sh", ["ckpt", "tb", "MOCK", "MOCK", "MOCK"], tmp_path)
    script = _parsed(pretrain_arguments, monkeypatch, world_size=8)
    config_path = os.path.join(ROOT, "examples", "gpt3", "config.yaml")
    from_yaml = _parsed(["--config-file", config_path], monkeypatch, world_size=8)
    with open(config_path) as stream:
        keys = [key.replace("-", "_") for key in yaml.safe_load(stream)]
    differences = {key: (getattr(script, key), getattr(from_yaml, key)) for key in keys
                   if getattr(script, key) != getattr(from_yaml, key)}
    assert differences == {}


def test_gpt3_scripts_pass_real_tokenizer_files_data_and_the_cluster_layout(tmp_path):
    torchrun_arguments, pretrain_arguments = _captured_launch(
        "examples/gpt3/train_gpt3_350m.sh", ["ckpt", "tb", "vocab.json", "merges.txt", "corpus_text_document",
                                             "--train-samples", "100"],
        tmp_path, GPUS_PER_NODE="8", NUM_NODES="4", NODE_RANK="3", MASTER_ADDR="node0", MASTER_PORT="6001")
    assert torchrun_arguments == ["--nproc_per_node", "8", "--nnodes", "4", "--node_rank", "3",
                                  "--master_addr", "node0", "--master_port", "6001"]
    text = " ".join(pretrain_arguments)
    assert "--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt" in text
    assert "--data-path corpus_text_document" in text and "--mock-data" not in text
    assert pretrain_arguments[-2:] == ["--train-samples", "100"]  # extra flags come last, so they win


def test_llama3_8b_script_shape_and_hugging_face_tokenizer(tmp_path, monkeypatch):
    _, pretrain_arguments = _captured_launch(
        "examples/llama/train_llama3_8b.sh", ["ckpt", "tb", "/models/llama3-tokenizer", "corpus_text_document"],
        tmp_path, GPUS_PER_NODE="8")
    args = _parsed(pretrain_arguments, monkeypatch, world_size=8)
    # Llama 3 8B (Meta's config.json): 32 layers, 4096 wide, 14336 FFN, 32 heads, 8 KV heads, 128 per head.
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (32, 4096, 14336)
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels) == (32, 8, 128)
    assert (args.seq_length, args.position_embedding_type, args.rotary_base) == (8192, "rope", 1000000)
    assert args.swiglu and args.normalization == "RMSNorm" and args.untie_embeddings_and_output_weights
    assert not args.add_bias_linear and args.hidden_dropout == 0.0 and args.attention_dropout == 0.0
    assert args.bf16 and args.fp8 is None
    assert (args.tokenizer_type, args.tokenizer_model, args.data_path) == (
        "HuggingFaceTokenizer", "/models/llama3-tokenizer", ["corpus_text_document"])


@pytest.mark.parametrize("script, arguments", [
    ("examples/gpt3/train_gpt3_125m.sh", ["ckpt", "tb", "MOCK"]),
    ("examples/llama/train_llama3_8b.sh", ["ckpt", "--num-layers", "2"]),
])
def test_scripts_refuse_missing_positional_arguments_with_a_usage_line(script, arguments, tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, script), *arguments], cwd=tmp_path, capture_output=True,
                            text=True, env=_environment())
    assert result.returncode == 1
    assert "usage:" in result.stderr and "TENSORBOARD_LOGS_PATH" in result.stderr


def test_gpt3_175b_arguments_parse_and_validate(tmp_path, monkeypatch):
    torchrun_arguments, pretrain_arguments = _captured_launch(
        "examples/gpt3/train_gpt3_175b_distributed.sh", ["ckpt", "tb", "MOCK", "MOCK", "MOCK"], tmp_path,
        GPUS_PER_NODE="8", NUM_NODES="16")
    assert torchrun_arguments[:4] == ["--nproc_per_node", "8", "--nnodes", "16"]  # 128 ranks
    args = _parsed(pretrain_arguments, monkeypatch, world_size=128)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == (96, 12288, 96, 2048)
    assert (args.micro_batch_size, args.global_batch_size, args.rampup_batch_size) == (1, 1536, [16, 16, 5859375])
    assert args.fp16 and args.init_method_std == 0.006 and (args.lr, args.min_lr) == (6.0e-5, 6.0e-6)
    validate_args(args, SCRIPT_DEFAULTS)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (8, 16, 1)
    assert args.virtual_pipeline_model_parallel_size is None  # 96 layers, 6 per stage, 1F1B


SIMPLE_LOOP = os.path.join(ROOT, "examples", "run_simple_mcore_train_loop.py")


def _simple_loop_losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"^iteration \d+: lm loss ([0-9.]+)", output, re.MULTILINE)]


@pytest.fixture(scope="module")
def simple_loop_runs(tmp_path_factory):
    """The loop as one process (TP=1) and under torchrun with 2 ranks (TP=2): (output, checkpoint dir)."""
    work = tmp_path_factory.mktemp("simple_loop")
    single = _run([sys.executable, SIMPLE_LOOP, "--checkpoint-dir", "single"], cwd=work)
    # --standalone: torchrun's store binds a free port itself (a port probed free beforehand can be taken by
    # a concurrent test's run before torchrun binds it).
    torchrun = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                     SIMPLE_LOOP, "--checkpoint-dir", "tp2"], cwd=work)
    return {"single": (single, work / "single"), "tp2": (torchrun, work / "tp2")}


@pytest.mark.parametrize("run, shards", [("single", 1), ("tp2", 2)])
def test_simple_mcore_loop_trains_saves_and_reloads(simple_loop_runs, run, shards):
    output, checkpoint_dir = simple_loop_runs[run]
    losses = _simple_loop_losses(output)
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5, losses
    assert "checkpoint reload check passed" in output
    assert sorted(os.listdir(checkpoint_dir)) == [f"tp_rank_{rank:02d}.pt" for rank in range(shards)]
    # Each TP rank holds its half of the 128-row embedding table.
    embedding = torch.load(checkpoint_dir / "tp_rank_00.pt", weights_only=True)["embedding.word_embeddings.weight"]
    assert embedding.shape == (128 // shards, 64)


def test_simple_mcore_loop_at_tp2_computes_the_single_process_losses(simple_loop_runs):
    assert "note: one process, so TP=1" in simple_loop_runs["single"][0]
    single = _simple_loop_losses(simple_loop_runs["single"][0])
    tensor_parallel = _simple_loop_losses(simple_loop_runs["tp2"][0])
    assert tensor_parallel == pytest.approx(single, abs=1e-4)
