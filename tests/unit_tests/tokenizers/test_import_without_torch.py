"""The tokenizer package must import on a machine without torch (tools/preprocess_data.py needs no GPU stack)."""

import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_import_pulls_in_no_torch_no_megatron_outside_and_no_optional_back_end():
    code = (
        "import json, sys\n"
        "import megatron.training.tokenizer as tokenizer\n"
        "tokenizer.build_tokenizer\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    modules = json.loads(result.stdout)
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "transformers", "sentencepiece", "tiktoken")]
    assert heavy == []
    megatron = {m for m in modules if m.startswith("megatron")}
    assert megatron <= {"megatron", "megatron.training"} | {m for m in megatron if m.startswith("megatron.training.tokenizer")}
