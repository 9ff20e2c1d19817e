"""Two "nodes" on this machine: two torchrun launchers (2 processes each) on loopback rendezvous, gloo.

They must train as one 4-process data-parallel job: the same losses as one process running the same global
batch as 4 microbatches (tolerance: fp32 reduction-order differences, rtol 1e-5).
"""

import os
import subprocess
import sys

from .harness import ROOT, free_port, read_scalars, run

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--train-iters", "4", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]


def test_two_torchrun_launchers_train_as_one_job(tmp_path):
    port = free_port()
    environment = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    launchers = []
    for node_rank in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", port,
            os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, "--tensorboard-dir", str(tmp_path / "multi"),
        ]
        launchers.append(subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    for launcher, output in zip(launchers, outputs):
        assert launcher.returncode == 0, output[-4000:]
    assert "world_size ...................................... 4" in outputs[0]

    run("pretrain_gpt.py", MODEL + ["--tensorboard-dir", str(tmp_path / "single")])
    multi, single = read_scalars(str(tmp_path / "multi"), "lm loss"), read_scalars(str(tmp_path / "single"), "lm loss")
    assert sorted(multi) == sorted(single) == [1, 2, 3, 4]
    for step in single:
        assert abs(multi[step] - single[step]) <= 1e-5 * abs(single[step]), (step, multi[step], single[step])
