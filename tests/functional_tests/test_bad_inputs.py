"""One test per bad input of the tables in bad_inputs.py and bad_inputs_run.py: each ends with a non-zero
exit status, its documented `error:` message and no traceback, and leaves nothing complete-looking behind;
and docs/bad_inputs.md is that table, rendered (regenerate: python -m tests.functional_tests.bad_inputs --write)."""

import pytest

from megatron.training import errors

from .bad_inputs import DOC, all_cases, error_message, markdown

CASES = all_cases()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_its_message(name, tmp_path, tmp_path_factory, monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_TRACEBACK"):
        monkeypatch.delenv(variable, raising=False)
    # Rows on a world of 2 print through the once-per-launch markers: fresh ones for each row.
    markers = str(tmp_path_factory.mktemp("markers"))
    monkeypatch.setattr(errors.tempfile, "gettempdir", lambda: markers)
    case = CASES[name]
    message = error_message(case, str(tmp_path))
    assert case.message.replace("{scratch}", str(tmp_path)) in message, message
    if case.after is not None:
        case.after(str(tmp_path))


def test_documented_table_is_the_tested_one():
    with open(DOC) as stream:
        assert stream.read() == markdown(), "run: python -m tests.functional_tests.bad_inputs --write"
