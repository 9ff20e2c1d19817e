"""The entry points' error convention (megatron/training/errors.py): which errors are the user's (one
`error:` line, no traceback), which keep their traceback, MEGATRON_TRACEBACK, one message per launch under
torchrun, Ctrl-C; and the tools' small contracts (convert.py --help, doctor's environment section)."""

import pytest
import torch

from megatron.training import errors
from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import report_error, run_entry_point

BAD_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
             "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
             "--vocab-size 128 --fp16 --bf16").split()


@pytest.fixture(autouse=True)
def one_process(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(errors.tempfile, "gettempdir", lambda: str(tmp_path))  # the markers of report_error


def _validate_bad_flags():
    validate_args(parse_args(args_list=BAD_FLAGS))


def test_user_error_prints_one_line_and_exits_1(capsys):
    with pytest.raises(SystemExit) as stopped:
        run_entry_point(_validate_bad_flags)
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 1 problem(s) with the arguments:\n  - --fp16 and --bf16 are mutually exclusive")
    assert "Traceback" not in err


def test_unexpected_errors_keep_their_traceback():
    def bug():
        return [][1]

    with pytest.raises(IndexError):
        run_entry_point(bug)
    # A ValueError raised inside torch (not by this project on purpose) is not a user error either.
    with pytest.raises(ValueError, match="Invalid learning rate"):
        run_entry_point(torch.optim.Adam, [torch.zeros(1, requires_grad=True)], lr=-1.0)


def test_megatron_traceback_shows_the_traceback_of_user_errors(monkeypatch):
    monkeypatch.setenv("MEGATRON_TRACEBACK", "1")
    with pytest.raises(ValueError, match="--fp16 and --bf16 are mutually exclusive"):
        run_entry_point(_validate_bad_flags)


def test_environment_errors_are_user_errors_wherever_raised(capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        run_entry_point(torch.load, str(tmp_path / "missing.pt"))
    assert stopped.value.code == 1
    assert capsys.readouterr().err == f"error: [Errno 2] No such file or directory: '{tmp_path / 'missing.pt'}'\n"


def test_ctrl_c_exits_130_without_traceback(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stopped:
        run_entry_point(interrupted)
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_a_non_zero_status_is_the_exit_status_and_zero_returns():
    assert run_entry_point(lambda: 0) == 0
    with pytest.raises(SystemExit) as stopped:
        run_entry_point(lambda: 3)
    assert stopped.value.code == 3


def test_each_message_once_per_launch_and_host(monkeypatch, capsys):
    """Ranks of one launch share the parent process (torchrun's agent): the first to report a message
    prints it; the others stay quiet. Another message, or another launch, prints again."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    report_error("same on every rank")
    report_error("same on every rank")
    report_error("only rank 1 meets this")
    monkeypatch.setenv("MASTER_PORT", "29501")
    report_error("same on every rank")
    assert capsys.readouterr().err.splitlines() == [
        "error: same on every rank", "error: only rank 1 meets this", "error: same on every rank"]


def test_argparse_errors_follow_the_convention(capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(args_list=["--num-layer", "2"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --num-layer 2 (--num-layer: did you mean --num-layers?)")
    assert "usage:" not in err  # hundreds of lines for the training flags; --help shows them


def test_convert_help_lists_the_plugins_flags_and_exits_0(capsys):
    from megatron.training.checkpointing.conversion.convert import main

    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    assert "--target-tensor-parallel-size" in capsys.readouterr().out


def test_doctor_environment_section_is_never_empty(monkeypatch):
    from megatron.doctor import ENVIRONMENT_VARIABLES, report

    for name in ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    lines = report()
    section = lines[lines.index("environment:") + 1:]
    assert section == [f"  not set: {', '.join(ENVIRONMENT_VARIABLES)}"]


def test_estimate_tool_runs_the_checks_made_before_the_model(monkeypatch, tmp_path, capsys):
    from megatron.training import global_vars
    from tests.unit_tests.tools.tool_loader import load_tool

    flags = [flag for flag in BAD_FLAGS if flag not in ("--fp16", "--bf16", "--mock-data")]
    monkeypatch.setattr("sys.argv", ["estimate.py", *flags, "--data-path", str(tmp_path / "nope"), "--split", "1"])
    try:
        with pytest.raises(SystemExit) as stopped:
            run_entry_point(load_tool("estimate").main)
    finally:
        global_vars.unset_global_variables()
    assert stopped.value.code == 1
    assert "error: 1 problem(s) found before building the model:\n  - " in capsys.readouterr().err
