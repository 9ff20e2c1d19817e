"""Start-up banner lines (layout, environment, data blend epochs) and the progress bar / progress.txt."""

import sys

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.extensions.apex import load_fused_norms
from megatron.core.extensions.flash_attn import load_flash_attention
from megatron.core.optimizer import adam_step_kernel
from megatron.training.arguments import parse_args, validate_args
from megatron.training.banner import banner_lines
from megatron.training.progress import ProgressLog, progress_bar
from megatron.training.train_state import TrainState

FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 25 --lr 1e-3 --tokenizer-type NullTokenizer "
         "--vocab-size 128").split()


def _dataset(prefix: str, tokens: int) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(np.arange(tokens) % 100, [tokens])
    builder.finalize(prefix + ".idx")
    return prefix


def _args(monkeypatch, *flags):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    args = validate_args(parse_args(args_list=[*FLAGS, *flags]))
    args.padded_vocab_size = 128
    return args


def _ranks(count: int) -> list:
    return [{"rank": rank, "host": "node", "tp": 0, "pp": 0, "dp": rank, "cp": 0, "ep": 0, "parameters": 1000 + rank}
            for rank in range(count)]


def test_banner_names_each_dataset_with_weight_and_epochs(tmp_path, monkeypatch):
    small, large = _dataset(str(tmp_path / "small"), 400), _dataset(str(tmp_path / "large"), 3200)
    args = _args(monkeypatch, "--data-path", "1", small, "3", large, "--split", "100,0,0")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    text = "\n".join(banner_lines(args, _ranks(2), num_microbatches=2))
    # 25 iterations x 4 sequences x 16 tokens = 1600 tokens: a quarter from `small` (400 tokens, 1 epoch),
    # three quarters from `large` (1200 of 3200 tokens, 0.375 epochs).
    assert "data (train): 1,600 tokens over 2 dataset(s)" in text
    assert f"weight 0.250     1.000 epochs of 400 tokens  {small}" in text
    assert f"weight 0.750     0.375 epochs of 3,200 tokens  {large}" in text
    assert "NCCL_DEBUG=INFO" in text and "CUDA_DEVICE_MAX_CONNECTIONS unset" in text
    assert "rank    1 on node: tp 0 pp 0 dp 1 cp 0 ep 0, 1,001 parameters" in text
    assert "64 tokens per iteration (4 sequences of 16)" in text


def test_banner_summarises_a_large_world(monkeypatch):
    text = "\n".join(banner_lines(_args(monkeypatch, "--mock-data"), _ranks(40), num_microbatches=2))
    assert "rank   31 on node" in text and "rank   32 on node" not in text
    assert "... 8 more ranks; parameters per rank from 1,000 to 1,039" in text


def test_banner_names_the_kernels_of_attention_norms_and_optimizer(monkeypatch):
    for name in ("flash_attn", "apex", "apex.normalization", "apex.normalization.fused_layer_norm",
                 "transformer_engine"):
        monkeypatch.setitem(sys.modules, name, None)  # none of them installed
    load_flash_attention.cache_clear()
    load_fused_norms.cache_clear()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    text = "\n".join(banner_lines(_args(monkeypatch, "--mock-data", "--bf16"), _ranks(1), num_microbatches=2))
    assert "  attention: torch SDPA" in text and "; flash-attn not installed" in text
    assert "  norms: torch layer_norm / rms_norm, compiled on CUDA (apex's fused norms not installed)" in text
    assert f"  optimizer: {adam_step_kernel(device_type, True)}; apex FusedAdam is not used" in text
    assert "  Transformer Engine: not installed (not needed: the layers are pure PyTorch)" in text
    args = _args(monkeypatch, "--mock-data", "--attention-backend", "unfused", "--optimizer", "sgd")
    text = "\n".join(banner_lines(args, _ranks(1), num_microbatches=2))
    assert "  attention: unfused matmul-softmax-matmul" in text and "  optimizer: torch SGD" in text
    args = _args(monkeypatch, "--mock-data", "--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                 "--exp-avg-dtype", "bf16")
    text = "\n".join(banner_lines(args, _ranks(1), num_microbatches=2))
    assert f"  optimizer: {adam_step_kernel(device_type, True, True)}; apex FusedAdam is not used" in text
    assert ", bf16 moments; apex" in text
    for backend, kernels in (("auto", "cuDNN's fused attention (sm90+"), ("flash", "PyTorch's FlashAttention-2")):
        args = _args(monkeypatch, "--mock-data", "--bf16", "--attention-backend", backend)
        args.context_parallel_size = 2  # (validation wants 2 ranks for it)
        text = "\n".join(banner_lines(args, _ranks(1), num_microbatches=2))
        assert f"  attention: context-parallel blocks (p2p): {kernels}" in text
    load_flash_attention.cache_clear()
    load_fused_norms.cache_clear()


def test_progress_bar():
    assert progress_bar(0, 10) == "[--------------------]   0%"
    assert progress_bar(45, 100) == "[#########-----------]  45%"
    assert progress_bar(7, 7, width=4) == "[####] 100%"


def test_progress_file_has_megatrons_format(tmp_path, monkeypatch):
    args = _args(monkeypatch, "--mock-data", "--save", str(tmp_path), "--save-interval", "5", "--log-progress")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    log = ProgressLog(args, start_flops=0.0)
    log.job_started()
    log.checkpoint_saved(TrainState(iteration=5, consumed_train_samples=20, num_floating_point_operations_so_far=2.5e9))
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[1:3] for line in lines] == [["Job ID: 4242", "# GPUs: 1"]] * 2
    assert lines[0].endswith("\tStarting job")
    fields = lines[1].split("\t")[3:]
    assert fields[:2] == ["Saved checkpoint", "Iteration: 5"] and fields[2].startswith("Job throughput: ")
    assert fields[3:] == ["Floating-point operations: 2.50e+09", "Tokens (in billions): 0.00"]


def test_banner_names_the_fp8_recipe_and_layers(monkeypatch):
    args = _args(monkeypatch, "--mock-data", "--num-layers", "4", "--bf16", "--fp8-format", "hybrid",
                 "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--first-last-layers-bf16")
    text = "\n".join(banner_lines(args, _ranks(1), num_microbatches=2))
    assert ("fp8 hybrid: E4M3 inputs and weights, E5M2 output gradients, delayed scaling (amax history 1024, max, "
            "margin 0), weight gradients in FP8; the transformer layers' linears through torch._scaled_mm; layers 2 "
            "to 3 (the first 1 and last 1 in bf16)") in text
    args = _args(monkeypatch, "--mock-data", "--bf16", "--fp8-format", "hybrid", "--fp8-param-gather",
                 "--use-distributed-optimizer")
    assert ("(embedding and output layer in bf16); their weights stored in FP8, cast from the fp32 main params "
            "and all-gathered as FP8 bytes (--fp8-param-gather)") in "\n".join(banner_lines(args, _ranks(1), 2))
