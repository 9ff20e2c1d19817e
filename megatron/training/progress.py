"""Progress: a bar in the console line when it goes to a terminal, and Megatron's `--log-progress` file.

`--log-progress` appends to `<save>/progress.txt` on rank 0, in Megatron-LM's format (tab-separated):

    2026-11-22 14:00:00	Job ID: 1234	# GPUs: 8	Starting job
    2026-11-22 14:10:00	Job ID: 1234	# GPUs: 8	Saved checkpoint	Iteration: 100	Job throughput: 123.456 TFLOP/s/GPU
        	Floating-point operations: 1.23e+18	Tokens (in billions): 0.05

(one line per event; the job id is SLURM_JOB_ID). Job throughput counts the FLOPs of this job since it
started, divided by its wall time and GPU count.
"""

import os
import time
from datetime import datetime

import torch.distributed as dist

BAR_WIDTH = 20


def progress_bar(iteration: int, total: int, width: int = BAR_WIDTH) -> str:
    """`[#########-----------]  45%` for iteration of total."""
    fraction = min(max(iteration / total, 0.0), 1.0) if total else 1.0
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {100 * fraction:3.0f}%"


class ProgressLog:
    """`--log-progress`: appends job events to `<save>/progress.txt` (rank 0; a no-op without --save)."""

    def __init__(self, args, start_flops: float):
        """`start_flops`: the run's floating-point operations when this job started (a resumed run's are not
        this job's)."""
        self.enabled = bool(args.log_progress and args.save)
        self.world_size = args.world_size
        self.seq_length = args.seq_length
        self.start_time = time.time()
        self.start_flops = start_flops
        self.filename = os.path.join(args.save, "progress.txt") if self.enabled else None

    def _append(self, text: str) -> None:
        if not self.enabled or (dist.is_initialized() and dist.get_rank() != 0):
            return
        os.makedirs(os.path.dirname(self.filename), exist_ok=True)
        with open(self.filename, "a") as stream:
            stream.write(f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t"
                         f"# GPUs: {self.world_size}\t{text}\n")

    def job_started(self) -> None:
        self._append("Starting job")

    def checkpoint_saved(self, state) -> None:
        """A checkpoint of the run's `TrainState` `state` was saved."""
        elapsed = max(time.time() - self.start_time, 1e-9)
        job_flops = state.num_floating_point_operations_so_far - self.start_flops
        tokens = state.consumed_train_samples * self.seq_length
        self._append(
            f"Saved checkpoint\tIteration: {state.iteration}\tJob throughput: "
            f"{job_flops / elapsed / self.world_size / 1e12:.3f} TFLOP/s/GPU\t"
            f"Floating-point operations: {state.num_floating_point_operations_so_far:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}"
        )
