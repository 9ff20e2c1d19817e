"""A run that writes and reads no torch_dist checkpoint never loads torch.distributed.checkpoint: a second of
every process's start-up (each rank of every run, every test that launches one); it loads where it is used.
(torch.distributed.fsdp and DTensor come with torch._dynamo, which torch.optim's optimizers load.)"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HEAVY = ("torch.distributed.checkpoint",)


def test_a_run_without_torch_dist_checkpoints_does_not_load_dcp():
    code = (
        "import runpy, sys; sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        f"print('loaded:', [name for name in {HEAVY!r} if name in sys.modules])\n"
    )
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--eval-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded: []" in result.stdout, result.stdout[-2000:]
