"""The repository stands on its own: no tracked file cites the development team's private notes.

Code, tests, tools and docs state the facts they rely on (Megatron-LM's file and function names, a formula, a
public issue) or point to a document under docs/. Citations of notes a reader cannot open (the team's
Megatron-LM compatibility reference, style/design/performance notes, user pain-point and tutorial-command
lists, anything in the shared folder beside the checkout) are refused here, with the file and line of each.
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# The notes' names are written in pieces so that this guard does not itself turn up in a search for them.
_NOTE = "megatron" "-compat"
_NOTE_FILES = "|".join(("STY" "LE", "DES" "IGN", "PE" "RF"))
_PAIN, _TUTORIAL, _SHARED = "user-" "pain-points", "tutorial" "-commands", r"\.\./sha" "red/"
PRIVATE_CITATION = re.compile(
    rf"{_NOTE}"
    rf"|{_PAIN}|pain points? [A-D]?\d"
    rf"|{_TUTORIAL}"
    rf"|\b(?:{_NOTE_FILES})\.md\b"
    rf"|{_SHARED}|/work/(?:shared|notes)\b"
    r"|reference section \d"
)


def tracked_files() -> list[str]:
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout, so there is no list of tracked files: {error}")
    return [name for name in listing.decode("utf-8").split("\0") if name]


def citations(text: str) -> list[tuple[int, str]]:
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if PRIVATE_CITATION.search(line)
    ]


def test_the_pattern_catches_each_kind_of_private_citation():
    cited = [
        f"({_NOTE}.md 3.4)", f"({_PAIN} A6)", "pain point A2", f"reference/{_TUTORIAL}.md",
        "as STY" "LE.md 5 asks", "(DES" "IGN.md)", "the PE" "RF.md shapes", "`../sha" "red/notes.md`",
        "reference section 7.6",
    ]
    assert [bool(PRIVATE_CITATION.search(line)) for line in cited] == [True] * len(cited)
    standalone = ["Megatron-LM's `get_train_valid_test_num_samples`", "docs/benchmarks.md", "README.md",
                  "NVIDIA/Megatron-LM#1476", "the reference model"]
    assert not any(PRIVATE_CITATION.search(line) for line in standalone)


def test_no_tracked_file_cites_the_team_notes():
    this_file = os.path.relpath(__file__, ROOT)
    found = []
    for name in tracked_files():
        path = os.path.join(ROOT, name)
        if name == this_file or not os.path.isfile(path):
            continue
        with open(path, "rb") as stream:
            data = stream.read()
        if b"\0" in data[:8192]:  # binary (checkpoint fixtures, images)
            continue
        found += [f"{name}:{number}: {line}" for number, line in citations(data.decode("utf-8", "replace"))]
    assert not found, (
        "these lines cite notes outside the repository; state the fact itself (or put it under docs/):\n"
        + "\n".join(found)
    )
