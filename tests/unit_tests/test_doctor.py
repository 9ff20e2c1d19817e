"""`python -m megatron doctor` reports versions, optional packages, the kernels a run will use and the environment."""

import subprocess
import sys

import torch


def test_doctor_reports_versions_backends_and_environment():
    result = subprocess.run(
        [sys.executable, "-m", "megatron", "doctor"], capture_output=True, text=True, timeout=120,
        env={"PATH": "", "NCCL_DEBUG": "WARN", "PYTHONPATH": ":".join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"torch           {torch.__version__}" in out
    assert "transformer_engine" in out and "flash_attn" in out and "torchao" in out
    assert "NCCL_DEBUG=WARN" in out
    for backend in ("attention       ", "norms           ", "optimizer       ", "TE              "):
        assert f"\n{backend}" in out  # the kernels a run will use
    assert "apex FusedAdam is not used" in out
    assert ("nccl" in out) if torch.cuda.is_available() else ("gloo" in out)


def test_unknown_command_prints_usage():
    result = subprocess.run([sys.executable, "-m", "megatron", "nope"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: python -m megatron" in result.stderr
