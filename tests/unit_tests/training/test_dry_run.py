"""`--dry-run`: validation for a world size without torch.distributed, and the report's numbers."""

import os
import subprocess
import sys

from megatron.training.arguments import parse_args, validate_args
from megatron.training.dry_run import dry_run_report
from megatron.training.memory_estimate import estimate_memory, total_parameters
from megatron.training.training_log import num_floating_point_operations

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FLAGS = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings "
         "1024 --micro-batch-size 2 --global-batch-size 64 --tensor-model-parallel-size 2 --bf16 --train-iters 10 "
         "--lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257").split()


def test_report_for_eight_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("RANK", raising=False)
    args = validate_args(parse_args(args_list=FLAGS))
    args.padded_vocab_size = 50432  # 50257 padded to a multiple of 128 x TP 2
    report = dry_run_report(args)
    assert "valid for world size 8" in report and "TP 2 x PP 1 x CP 1 x DP 4" in report
    assert f"{total_parameters(args):,} in total" in report
    assert "global 64 = micro 2 x 8 microbatches x DP 4; 65,536 tokens per iteration" in report
    assert f"{num_floating_point_operations(args, 64):.4e}" in report
    estimate = estimate_memory(args, 8)
    assert f"{estimate.total / 1024**3:10.2f}     {estimate.total_full_recompute / 1024**3:10.2f}" in report


def test_pretrain_dry_run_needs_no_process_group_and_reports_all_problems():
    environment = dict(os.environ, WORLD_SIZE="8", OMP_NUM_THREADS="1")
    environment.pop("RANK", None)
    script = os.path.join(ROOT, "pretrain_gpt.py")
    result = subprocess.run([sys.executable, script, *FLAGS, "--dry-run"], capture_output=True, text=True,
                            env=environment, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dry run: the arguments are valid for world size 8" in result.stdout
    assert "time to initialize megatron" not in result.stdout  # torch.distributed was never started
    bad = subprocess.run([sys.executable, script, *FLAGS, "--dry-run", "--tensor-model-parallel-size", "3"],
                         capture_output=True, text=True, env=environment, cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "world size 8 is not divisible by TP 3" in bad.stderr
