"""Write the Python standard library's sources as a loose-JSON corpus: a dataset that needs no download.

    python tools/build_stdlib_corpus.py --output data/stdlib.jsonl

One line per `.py` file of the running interpreter's standard library (site-packages excluded), as
`{"text": <source>, "path": <path relative to the stdlib>}`, in sorted path order - Python code, like the
CodeParrot corpus of Megatron's GPT tutorial. The test suites (`test/`, `tests/`, `idle_test/`) are left
out unless `--include-tests`. Files that are not valid UTF-8 (a few deliberate test fixtures) are skipped.
The file appears only when complete.
"""

import json
import os
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a clone without pip install

from megatron.training.errors import ArgumentParser, run_entry_point  # noqa: E402

_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_sources(include_tests: bool):
    """Yields (relative path, text) for every stdlib `.py` file, sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != "site-packages" and (include_tests or d not in _TEST_DIRS)]
        found.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    for path in sorted(found):
        try:
            with open(path, encoding="utf-8") as stream:
                text = stream.read()
        except (UnicodeDecodeError, OSError):
            continue
        yield os.path.relpath(path, root), text


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    parser.add_argument("--include-tests", action="store_true", help="also take the stdlib's test suites")
    parser.add_argument("--max-files", type=int, default=None, help="stop after this many files")
    args = parser.parse_args(argv)

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    partial = args.output + ".incomplete"
    count = size = 0
    try:
        with open(partial, "w", encoding="utf-8") as stream:
            for path, text in stdlib_sources(args.include_tests):
                if args.max_files is not None and count >= args.max_files:
                    break
                stream.write(json.dumps({"text": text, "path": path}, ensure_ascii=False) + "\n")
                count += 1
                size += len(text.encode("utf-8"))
        os.replace(partial, args.output)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    print(f"Wrote {count} documents ({size / 1e6:.1f} MB of Python) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_entry_point(main)
