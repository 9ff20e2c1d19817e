"""Lay out the Megatron-LM source that `make_fixtures.py` runs, on a machine that has the Megatron-LM git
repository, for a GPU machine that may have neither a network nor a C++ tool chain:

    python tools/megatron_interop/prepare_megatron.py --repo /path/to/Megatron-LM/.git \
        --output .megatron-lm --python python3.12 --pybind11-wheel .whl/pybind11-3.1.0-py3-none-any.whl

- `git archive HEAD` of what `pretrain_gpt.py` imports: `megatron/`, `pretrain_gpt.py`, `gpt_builders.py`,
  `model_provider.py` (13 MB); the commit is written to `.megatron-lm/COMMIT`.
- Megatron-LM compiles its dataset helpers (`megatron/core/datasets/helpers.cpp`, pybind11) with `make` at
  start-up; this builds `helpers_cpp<suffix>.so` here, with the Python (same minor version as the GPU
  machine's) and pybind11 headers given, so the GPU machine needs neither g++ nor Python's headers.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile

SOURCES = ["megatron", "pretrain_gpt.py", "gpt_builders.py", "model_provider.py"]
HELPERS = os.path.join("megatron", "core", "datasets")


def archive(repo: str, output: str) -> str:
    """Extracts SOURCES at the repository's HEAD into `output`; returns the commit."""
    commit = subprocess.run(["git", "--git-dir", repo, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    os.makedirs(output, exist_ok=True)
    tar = subprocess.Popen(["git", "--git-dir", repo, "archive", commit, *SOURCES], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", output], stdin=tar.stdout, check=True)
    if tar.wait() != 0:
        raise SystemExit(f"git archive of {repo} failed")
    with open(os.path.join(output, "COMMIT"), "w") as file:
        file.write(commit + "\n")
    return commit


def build_helpers(source: str, python: str, pybind11_include: str) -> str:
    """Compiles Megatron's dataset helpers for `python` (its headers and extension suffix), as its Makefile
    would; returns the path of the library."""
    query = "import sysconfig; print(sysconfig.get_paths()['include']); print(sysconfig.get_config_var('EXT_SUFFIX'))"
    include, suffix = subprocess.run([python, "-c", query], check=True, capture_output=True,
                                     text=True).stdout.split()
    folder = os.path.join(source, HELPERS)
    library = os.path.join(folder, "helpers_cpp" + suffix)
    subprocess.run(["g++", "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", f"-I{pybind11_include}",
                    f"-I{include}", os.path.join(folder, "helpers.cpp"), "-o", library], check=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="the Megatron-LM git directory (bare or .git)")
    parser.add_argument("--output", default=".megatron-lm", help="where the source goes")
    parser.add_argument("--python", default="python3.12", help="the interpreter the GPU machine runs")
    parser.add_argument("--pybind11-wheel", required=True, help="a pybind11 wheel (its headers are used)")
    args = parser.parse_args()
    commit = archive(args.repo, args.output)
    with tempfile.TemporaryDirectory() as work:
        with zipfile.ZipFile(args.pybind11_wheel) as wheel:
            wheel.extractall(work)
        library = build_helpers(args.output, args.python, os.path.join(work, "pybind11", "include"))
    print(f"Megatron-LM {commit} in {args.output}; dataset helpers: {library}", file=sys.stderr)


if __name__ == "__main__":
    main()
