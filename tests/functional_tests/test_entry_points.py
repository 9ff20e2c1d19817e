"""The entry points as a user starts them: a user error is one `error:` line and exit status 1 before the
model is built (once per job under torchrun), a run ends with its summary line, `--load` of an iteration
directory resumes from it, the save directory is locked only while its run lives, and a run (training,
evaluation, save, resume) never reads `get_args()`."""

import os
import re
import subprocess
import sys

from .harness import ROOT, run

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-workers", "0",
    "--log-interval", "1", "--eval-iters", "0",
]
CPU = {"CUDA_VISIBLE_DEVICES": ""}
ENVIRONMENT = dict(os.environ, OMP_NUM_THREADS="1", **CPU)


def _no_traceback_from_here(output: str) -> None:
    """torchrun prints its own ChildFailedError report; nothing may come from the ranks' code."""
    assert not re.search(r'File ".*(pretrain_gpt\.py|/megatron/)', output), output[-3000:]
    assert "[rank" not in output, output[-3000:]


def test_user_error_is_one_line_before_the_model_is_built(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                             *[flag for flag in TINY if flag != "--mock-data"], "--data-path", str(tmp_path / "nope"),
                             "--split", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENVIRONMENT)
    assert result.returncode == 1
    assert result.stderr.startswith("error: 1 problem(s) found before building the model:\n  - "), result.stderr
    assert "nope.idx not found" in result.stderr
    assert "Traceback" not in result.stderr and "building GPT model" not in result.stdout


def test_user_error_under_torchrun_is_printed_once(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--fp16", "--bf16"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENVIRONMENT)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("error: 1 problem(s) with the arguments:\n  - --fp16 and --bf16 are mutually exclusive") == 1
    _no_traceback_from_here(output)


def test_run_ends_with_its_summary_and_load_of_an_iteration_directory_resumes_it(tmp_path):
    first = run("pretrain_gpt.py", [*TINY, "--save", str(tmp_path / "a"), "--save-interval", "1"], env=CPU)
    summary = first.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"run summary: trained 2 iterations \(0 -> 2\), 32 tokens in \d+:\d\d:\d\d; started from "
                        rf"scratch; last checkpoint: {tmp_path / 'a' / 'iter_0000002'}", summary), summary
    assert not (tmp_path / "a" / ".save.lock").exists()  # released at exit

    second = run("pretrain_gpt.py", [*TINY, "--load", str(tmp_path / "a" / "iter_0000001"), "--save",
                                     str(tmp_path / "b"), "--save-interval", "5"], env=CPU)
    assert f"note: --load {tmp_path / 'a' / 'iter_0000001'} is one iteration of {tmp_path / 'a'}" in second.stdout
    assert re.search(r"iteration\s+2/\s+2 \|", second.stdout) and not re.search(r"iteration\s+1/", second.stdout)
    summary = second.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"run summary: trained 1 iterations \(1 -> 2\), 16 tokens in \d+:\d\d:\d\d; started from "
                        rf"checkpoint {tmp_path / 'a' / 'iter_0000001'} \(iteration 1\); last checkpoint: "
                        rf"{tmp_path / 'b' / 'iter_0000002'}", summary), summary


def test_a_run_and_its_resume_never_read_get_args(tmp_path):
    """`get_args()` raises in these runs (no_global_args_entry.py): the framework passes the arguments itself."""
    flags = [*TINY, "--eval-iters", "1", "--eval-interval", "1", "--lr-decay-iters", "2", "--save", str(tmp_path),
             "--save-interval", "1"]
    entry = os.path.join("tests", "functional_tests", "no_global_args_entry.py")
    run(entry, ["pretrain_gpt.py", *flags, "--train-iters", "1"], env=CPU)
    resumed = run(entry, ["pretrain_gpt.py", *flags, "--load", str(tmp_path)], env=CPU)
    assert re.search(r"iteration\s+2/\s+2 \|", resumed.stdout) and "validation loss at iteration 2" in resumed.stdout
