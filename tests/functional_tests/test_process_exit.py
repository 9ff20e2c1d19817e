"""A finished pretrain() leaves no gloo worker thread behind (the end of a run is not a race with teardown).

A gloo worker thread releases a finished collective's tensors a moment after the caller's wait() returned; a
release that falls into interpreter teardown needs the GIL there and aborts the rank with "terminate called
without an active exception" (CI saw it once in ~60 4-process runs on a loaded 2-core machine). pretrain()
therefore frees every process group it made before returning, which joins their worker threads. Each rank
here runs pretrain_gpt.py's main, then counts its threads named `pt_gloo_runloop` (Linux /proc), which must
be 0: PP=2 (point-to-point groups), the distributed optimizer, an evaluation and a torch_dist save (DCP's own
gloo group) all ran.
"""

import os
import subprocess
import sys

import pytest

from .harness import ROOT

ENTRY = """
import os, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
print(f"rank {os.environ['RANK']} gloo worker threads left: {names.count('pt_gloo_runloop')}", flush=True)
"""

ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
    "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-workers", "0",
    "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_pretrain_frees_every_gloo_group_before_it_returns(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--no-python", sys.executable, "-c", ENTRY, os.path.join(ROOT, "pretrain_gpt.py"), *ARGS,
               "--save", str(tmp_path / "checkpoints"), "--save-interval", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    for rank in (0, 1):
        assert f"rank {rank} gloo worker threads left: 0" in result.stdout, result.stdout[-4000:]
