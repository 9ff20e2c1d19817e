"""examples/quickstart.sh takes a relative WORKDIR from the caller's directory and makes a consistent short
run of TRAIN_ITERS=10; every CPU smoke command of examples/README.md logs a loss line (its log interval is
within its run). The quickstart runs against a stand-in `python` that records each command (the real one
takes minutes); the training command it records is then validated, schedule included, as pretrain() would."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args

from .harness import ROOT

STAND_IN = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["COMMANDS"], "a") as log:
    log.write(json.dumps({{"cwd": os.getcwd(), "argv": sys.argv[1:]}}) + "\\n")
if sys.argv[1:2] == ["-c"]:
    sys.exit(1) if "cuda" in sys.argv[2] else print(1)  # no GPU; 1 worker
"""


def test_quickstart_resolves_workdir_from_the_caller_and_runs_short(tmp_path):
    stand_in = tmp_path / "bin" / "python"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    (tmp_path / "caller").mkdir()
    environment = dict(os.environ, PATH=f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}", TRAIN_ITERS="10",
                       COMMANDS=str(tmp_path / "commands.jsonl"))
    subprocess.run(["bash", os.path.join(ROOT, "examples", "quickstart.sh"), "work"], cwd=tmp_path / "caller",
                   env=environment, check=True, capture_output=True, timeout=60)
    commands = [json.loads(line) for line in (tmp_path / "commands.jsonl").read_text().splitlines()]
    scripts = {command["argv"][0]: command["argv"][1:] for command in commands if command["argv"][0] != "-c"}
    assert scripts["tools/build_stdlib_corpus.py"] == ["--output", str(tmp_path / "caller" / "work" / "stdlib.jsonl")]

    args = validate_args(parse_args(args_list=scripts["pretrain_gpt.py"]), {"tokenizer_type": "GPT2BPETokenizer"})
    assert args.train_iters == 10 and args.log_interval <= 10 and args.eval_interval <= 10
    global_vars.set_args(args)
    try:
        from megatron.training.training import get_optimizer_param_scheduler

        get_optimizer_param_scheduler(SimpleNamespace(param_groups=[{}]))  # the warm-up fits the run
    finally:
        global_vars.unset_global_variables()


def _log_interval_of(script: str) -> int:
    """The --log-interval a script (or the recipe it sources) passes."""
    directory = os.path.dirname(script)
    text = open(script).read()
    for sourced in re.findall(r'source "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/([\w.]+)"', text):
        text += open(os.path.join(directory, sourced)).read()
    return int(re.search(r"--log-interval (\d+)", text).group(1))


def test_every_readme_smoke_command_logs_a_loss_line():
    readme = open(os.path.join(ROOT, "examples", "README.md")).read()
    blocks = re.findall(r"# CPU smoke test[^\n]*\n((?:.*\\\n)*.*\n)", readme)
    assert len(blocks) == readme.count("# CPU smoke test") >= 5
    for block in blocks:
        words = block.replace("\\\n", " ").split()
        flags = dict(zip(words, words[1:]))
        script = next(word for word in words if word.endswith(".sh"))
        log_interval = int(flags.get("--log-interval", _log_interval_of(os.path.join(ROOT, script))))
        iterations = (int(flags["--train-iters"]) if "--train-iters" in flags
                      else int(flags["--train-samples"]) // int(flags["--global-batch-size"]))
        assert log_interval <= iterations, (script, log_interval, iterations)
