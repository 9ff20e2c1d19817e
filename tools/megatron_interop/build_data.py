"""Build the real-text dataset of the Megatron-LM interchange fixtures, on a CPU, with this project's own tools:

    python tools/megatron_interop/build_data.py --output tests/fixtures/megatron_lm/data

1. `tools/build_stdlib_corpus.py --max-files 12`: the first 12 Python standard-library sources (sorted by
   path) as loose JSON;
2. each file cut at line boundaries into documents of at most 1,500 characters (about 70 documents, so the
   90/5/5 split gives every split whole documents and the document shuffle has something to shuffle);
3. `tools/train_tokenizer.py --type gpt2 --vocab-size 512`: a GPT-2 byte-level BPE, `vocab.json` +
   `merges.txt` (`<|endoftext|>` is id 511);
4. `tools/preprocess_data.py --append-eod`: `stdlib_text_document.bin/.idx` in Megatron's format.

The standard library differs between Python versions, so a rebuild elsewhere gives other tokens: the committed
files are the fixture, this script the record of how they were made.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_FILES = 12
MAX_DOCUMENT_CHARS = 1500
VOCAB_SIZE = 512
PREFIX = "stdlib_text_document"


def split_documents(text: str, limit: int) -> list[str]:
    """`text` cut at line ends into pieces of at most `limit` characters (a longer line is its own piece)."""
    pieces, current = [], ""
    for line in text.splitlines(keepends=True):
        if current and len(current) + len(line) > limit:
            pieces.append(current)
            current = ""
        current += line
    if current.strip():
        pieces.append(current)
    return pieces


def _tool(name: str, *args: str) -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=ROOT))


def build(output: str) -> None:
    os.makedirs(output, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        files = os.path.join(work, "files.jsonl")
        _tool("build_stdlib_corpus.py", "--output", files, "--max-files", str(MAX_FILES))
        corpus = os.path.join(work, "corpus.jsonl")
        with open(files) as source, open(corpus, "w") as sink:
            for line in source:
                for piece in split_documents(json.loads(line)["text"], MAX_DOCUMENT_CHARS):
                    sink.write(json.dumps({"text": piece}) + "\n")
        _tool("train_tokenizer.py", "--input", corpus, "--type", "gpt2", "--vocab-size", str(VOCAB_SIZE),
              "--output-dir", output)
        _tool("preprocess_data.py", "--input", corpus, "--output-prefix", os.path.join(output, "stdlib"),
              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(output, "vocab.json"),
              "--merge-file", os.path.join(output, "merges.txt"), "--append-eod", "--workers", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="folder for vocab.json, merges.txt and the .bin/.idx")
    build(parser.parse_args().output)


if __name__ == "__main__":
    main()
