"""The re-run engine in pretrain_gpt's loop (one CPU rank, a tiny GPT on mock data, 3 iterations of 2
microbatches): Megatron-LM's flags, its exit codes and log lines, the checkpoint of the state before the
re-run iteration, and the re-run computing exactly the initial run's loss (same data, same dropout masks).
"""

import os
import sys

import pytest
import torch

from megatron.core import rerun_state_machine

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools", "megatron_interop"))

from functional_runs import train_in_process  # noqa: E402

ARGS = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--train-iters", "3", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "64", "--num-workers", "0", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
    "--ckpt-format", "torch",
]
LOGGER = "megatron.core.rerun_state_machine"


def _exit_code(argv):
    with pytest.raises(SystemExit) as stopped:
        train_in_process(ARGS + argv)
    return stopped.value.code


def test_a_persistent_error_saves_the_state_before_the_iteration_and_exits_with_16(tmp_path, caplog, monkeypatch):
    compared = []
    real_compare = rerun_state_machine.RerunErrorInjector.maybe_miscompare

    def record(injector, comparison_func, initial_result, result):
        compared.append((initial_result.item(), result.item()))
        return real_compare(injector, comparison_func, initial_result, result)

    monkeypatch.setattr(rerun_state_machine.RerunErrorInjector, "maybe_miscompare", record)
    with caplog.at_level("WARNING", logger=LOGGER):
        code = _exit_code(["--rerun-mode", "validate_results", "--error-injection-rate", "1",
                           "--error-injection-type", "persistent_error", "--save", str(tmp_path),
                           "--save-interval", "100"])
    assert code == rerun_state_machine.EXIT_CODE_RESUME_TO_DISAMBIGUATE
    for line in ("Result validation enabled", "Injecting error type Persistent error",
                 "First rerun: unexpected result is reproducible within the tolerance",
                 "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
                 "iteration and establish a diagnostic"):
        assert line in caplog.text
    # The re-run of iteration 2 read the same tokens with the same dropout masks: the same loss, bit for bit.
    assert len(compared) == 1 and compared[0][0] == compared[0][1]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    saved = torch.load(tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["iteration"] == 1 and saved["args"].consumed_train_samples == 4


def test_a_transient_error_in_a_fatal_check_exits_with_17_without_a_checkpoint(tmp_path, caplog):
    with caplog.at_level("WARNING", logger=LOGGER):
        code = _exit_code(["--rerun-mode", "validate_results", "--error-injection-rate", "1",
                           "--save", str(tmp_path), "--save-interval", "100"])
    assert code == rerun_state_machine.EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert "Injecting error type Transient error" in caplog.text
    assert "Possible transient error!!" in caplog.text
    assert "Exiting now. The job can be resumed from a previous checkpoint" in caplog.text
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def _saved_model(directory):
    saved = torch.load(directory / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    return saved["model"]


def test_a_transient_spike_is_rerun_and_trains_as_the_run_without_the_engine(tmp_path, caplog):
    # Every iteration after the first is re-run (not fatal: training goes on with the re-run's gradients).
    with caplog.at_level("WARNING", logger=LOGGER):
        rerun = train_in_process(ARGS + ["--rerun-mode", "validate_results", "--error-injection-rate", "1",
                                         "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss",
                                         "--save", str(tmp_path / "rerun"), "--save-interval", "100"])
    assert rerun.consumed_train_samples == 12
    assert caplog.text.count("Need to rerun step to check reproducibility of initial result") == 2
    assert caplog.text.count("Continuing normal execution because failed validation was not fatal") == 2
    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):
        plain = train_in_process(ARGS + ["--rerun-mode", "disabled", "--save", str(tmp_path / "plain"),
                                         "--save-interval", "100"])
    assert plain.consumed_train_samples == 12
    assert "Result validation enabled" not in caplog.text
    rerun_model, plain_model = _saved_model(tmp_path / "rerun"), _saved_model(tmp_path / "plain")
    assert rerun_model.keys() == plain_model.keys()
    for name, value in plain_model.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(rerun_model[name], value), name
