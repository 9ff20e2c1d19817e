"""tools/bench/parallel_efficiency.py reads what the GPU runs print: the exposed communication of a profiler trace
and the measured intervals of the console lines (hand-made inputs with known answers)."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "bench"))
from parallel_efficiency import communication_per_step, failure_reason, measured  # noqa: E402


def test_exposed_communication_is_the_part_no_compute_kernel_covers(tmp_path):
    """Two steps; communication 0-10 and 30-40 us (NCCL), 50-60 us (a peer-to-peer copy); compute 5-35 us on
    two streams: 5 + 5 + 10 = 20 us of the 30 exposed, i.e. 0.015 / 0.010 ms per step; 40-50 us idle."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 30, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 50, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 5, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": 20, "dur": 15},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 55, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
    ]
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    result = communication_per_step(str(path), steps=2)
    assert result["comm ms/step"] == pytest.approx(0.015)
    assert result["exposed comm ms/step"] == pytest.approx(0.010)
    assert result["exposed by collective"] == pytest.approx({"AllGather": 0.0025, "SendRecv": 0.0025,
                                                             "Memcpy PtoP": 0.005})
    assert result["idle ms/step"] == pytest.approx(0.005)


def test_medians_leave_out_the_first_and_the_profiled_intervals():
    def line(iteration, ms, tokens):
        return (f" [2026-11-26] iteration {iteration:8d}/      25 | consumed samples: 1 | elapsed time per iteration "
                f"(ms): {ms} | tokens/s/GPU: {tokens} | throughput per GPU (TFLOP/s/GPU): 1.5 | lm loss: 2.0E+00 |")

    output = "\n".join([line(5, 900.0, 10), line(10, 100.0, 40), line(15, 110.0, 30), line(20, 120.0, 20),
                        line(25, 999.0, 5), "memory (MB) | allocated: 1.0 | max allocated: 321.5 | reserved: 2.0"])
    row = measured(output, profiled_from=21)
    assert (row["ms"], row["tokens/s/GPU"], row["TFLOP/s/GPU"], row["peak MB"]) == (110.0, 30.0, 1.5, 321.5)
    assert row["lm loss"] == 2.0


def test_a_failed_run_is_reported_by_what_its_workers_raised():
    """Not torchrun's ChildFailedError: a worker's exception, or the argument problems of the validation."""
    torchrun = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "  time      : 2026-11-27_12:55:15\n  error_file: <N/A>\n")
    crashed = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
               "[rank0]: RuntimeError: Expected all tensors to be on the same device\n" + torchrun)
    refused = ("using world size: 1\nerror: 2 problem(s) with the arguments:\n  - --num-query-groups 8 must divide "
               "--num-attention-heads 4\n  - global batch size 1 is not a multiple of 4\nE1127 failed\n" + torchrun)
    assert failure_reason(crashed) == "RuntimeError: Expected all tensors to be on the same device"
    assert failure_reason(refused) == ("error: 2 problem(s) with the arguments:; - --num-query-groups 8 must "
                                       "divide --num-attention-heads 4; - global batch size 1 is not a multiple of 4")
    assert failure_reason("Killed\n" + torchrun).endswith("error_file: <N/A>")
    listed = "tail of the output\nworkers raised:\nerror: 1 problem(s) with the arguments:\n- needs a CUDA device"
    assert failure_reason(listed) == "error: 1 problem(s) with the arguments:; - needs a CUDA device"
