"""Train a tokenizer on a loose-JSON corpus: GPT-2 byte-level BPE or BERT WordPiece.

    python tools/train_tokenizer.py --input corpus.jsonl --type gpt2 --vocab-size 8000 --output-dir tok/
    python tools/train_tokenizer.py --input corpus.jsonl --type wordpiece --vocab-size 8000 --output-dir tok/

`--type gpt2` writes `vocab.json` + `merges.txt` (use with `--tokenizer-type GPT2BPETokenizer --vocab-file
tok/vocab.json --merge-file tok/merges.txt`); `--type wordpiece` writes `vocab.txt` (use with
`--tokenizer-type BertWordPieceLowerCase --vocab-file tok/vocab.txt`, or `BertWordPieceCase` after
`--cased`). `--input` takes files, globs or directories, `.gz`/`.zst` included, as preprocess_data.py.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a clone without pip install

from megatron.core.tokenizers.training import train_gpt2_bpe, train_wordpiece  # noqa: E402
from megatron.preprocessing.inputs import find_input_files, iter_tasks  # noqa: E402
from megatron.training.errors import ArgumentParser, report_user_error, run_entry_point  # noqa: E402

DEFAULT_VOCAB_SIZE = {"gpt2": 50257, "wordpiece": 30522}


def iter_texts(paths: list[str], json_key: str):
    """Yields the `json_key` string of every JSON line of `paths`; a bad line stops with its file and number."""
    line_numbers = dict.fromkeys(paths, 0)
    for task in iter_tasks(paths):
        for raw in task.read().splitlines():
            line_numbers[task.path] += 1
            if not raw.strip():
                continue
            where = f"{task.path} line {line_numbers[task.path]}"
            try:
                document = json.loads(raw)
            except ValueError as error:
                raise ValueError(f"{where} is not valid JSON: {error}") from None
            if not isinstance(document, dict) or json_key not in document:
                keys = sorted(document) if isinstance(document, dict) else type(document).__name__
                raise ValueError(f"{where} has no --json-key {json_key!r} (found: {keys})")
            if not isinstance(document[json_key], str):
                raise ValueError(f"{where}: {json_key!r} is a {type(document[json_key]).__name__}, not a string")
            yield document[json_key]


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files, globs or directories")
    parser.add_argument("--json-key", default="text", help="the key holding each document's text")
    parser.add_argument("--type", choices=["gpt2", "wordpiece"], required=True, help="the kind of tokenizer")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokens in the vocabulary (default: 50257 for gpt2, 30522 for wordpiece)")
    parser.add_argument("--output-dir", required=True, help="where vocab.json + merges.txt or vocab.txt go")
    case = parser.add_mutually_exclusive_group()
    case.add_argument("--lowercase", dest="lowercase", action="store_true", default=True,
                      help="wordpiece: lower-case and strip accents (BertWordPieceLowerCase; the default)")
    case.add_argument("--cased", dest="lowercase", action="store_false", help="wordpiece: keep case (BertWordPieceCase)")
    args = parser.parse_args(argv)
    vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE[args.type]

    try:
        paths = [path for pattern in args.input for path in find_input_files(pattern)]
        texts = iter_texts(paths, args.json_key)
        progress = sys.stderr.isatty()
        if args.type == "gpt2":
            size = train_gpt2_bpe(texts, vocab_size, args.output_dir, show_progress=progress)
            written = "vocab.json and merges.txt"
        else:
            size = train_wordpiece(texts, vocab_size, args.output_dir, args.lowercase, show_progress=progress)
            written = "vocab.txt"
    except Exception as error:
        if not report_user_error(error):
            raise
        return 1
    print(f"Wrote {written} ({size} tokens) to {args.output_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_entry_point(main)
