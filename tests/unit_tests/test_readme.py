"""The README's quick start is what CI runs: its test command appears verbatim in .ci/run."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def quick_start_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as stream:
        readme = stream.read()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_is_two_commands():
    commands = quick_start_commands()
    assert len(commands) == 2 and all("\n" not in command for command in commands)
    assert commands[0].startswith("pip install -e . && ")
    assert commands[1].startswith('pip install -e ".[dev]" && ')


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as stream:
        ci_lines = [line.strip() for line in stream]
    assert quick_start_commands()[1] in ci_lines
