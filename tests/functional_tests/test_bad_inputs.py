"""One test per bad input of the table in bad_inputs.py: each gets its documented message; and
docs/bad_inputs.md is that table, rendered (regenerate: python -m tests.functional_tests.bad_inputs --write)."""

import pytest

from .bad_inputs import CASES, DOC, error_message, markdown


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_its_message(name, tmp_path, monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    case = CASES[name]
    message = error_message(case, str(tmp_path))
    assert case.message.replace("{scratch}", str(tmp_path)) in message, message


def test_documented_table_is_the_tested_one():
    with open(DOC) as stream:
        assert stream.read() == markdown(), "run: python -m tests.functional_tests.bad_inputs --write"
