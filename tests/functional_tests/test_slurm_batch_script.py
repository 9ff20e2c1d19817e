"""examples/slurm/pretrain.sbatch under stand-ins for SLURM's commands (no SLURM here): it starts the training
script once per node through srun with the rendezvous on the first node of the allocation, and SLURM's
preemption notice (USR1 to the batch shell) reaches the job step as SIGTERM, whose ranks then save and
exit 0 while the batch script waits for them.

The stand-ins: `scontrol show hostnames` lists the allocation, `srun` runs its command as node 0 of the
step (recording its pid), `scancel --signal=TERM` signals that pid; the training script records what it
was given and exits 0 on SIGTERM, as `pretrain_gpt.py --exit-signal-handler` does after saving.
"""

import os
import signal
import subprocess
import time

from .harness import ROOT

STAND_INS = {
    "scontrol": 'printf "node-a\\nnode-b\\n"\n',
    "srun": 'shift  # --kill-on-bad-exit=1\necho $$ > "$WORK/step.pid"\nexec env SLURM_NODEID=0 "$@"\n',
    "scancel": 'echo "$@" > "$WORK/scancel.args"\nkill -TERM "$(cat "$WORK/step.pid")"\n',
}
TRAINING_SCRIPT = """#!/bin/bash
trap 'echo saved >> "$WORK/training.log"; exit 0' TERM
echo "NUM_NODES=$NUM_NODES NODE_RANK=$NODE_RANK GPUS_PER_NODE=$GPUS_PER_NODE" \
    "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT" > "$WORK/training.log"
echo "$@" >> "$WORK/training.log"
while true; do sleep 0.1; done
"""


def _wait_for(path, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_batch_script_starts_each_node_and_forwards_the_preemption_notice(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    training = tmp_path / "train.sh"
    training.write_text(TRAINING_SCRIPT)
    environment = dict(os.environ, WORK=str(tmp_path), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                       SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="4")
    batch = subprocess.Popen(["bash", os.path.join(ROOT, "examples", "slurm", "pretrain.sbatch"), str(training),
                              "ckpt", "tb", "--train-iters", "10"], cwd=tmp_path, env=environment,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(tmp_path / "training.log")
    _wait_for(tmp_path / "step.pid")
    time.sleep(0.5)  # the batch shell is in `wait` with its trap set
    batch.send_signal(signal.SIGUSR1)
    output, _ = batch.communicate(timeout=60)
    assert batch.returncode == 0, output
    assert "preemption notice: asking every rank to save and exit" in output
    assert (tmp_path / "scancel.args").read_text().split() == ["--signal=TERM", "4242.0"]
    environment_line, arguments, saved = (tmp_path / "training.log").read_text().splitlines()
    assert environment_line == "NUM_NODES=2 NODE_RANK=0 GPUS_PER_NODE=4 MASTER_ADDR=node-a MASTER_PORT=29500"
    assert arguments == "ckpt tb --train-iters 10 --exit-signal-handler --exit-signal SIGTERM"
    assert saved == "saved"
